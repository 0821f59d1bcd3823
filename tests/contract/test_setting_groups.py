"""A config of setting groups built and changed by its settings' names (contract.setting_groups):
each name goes to the group that owns it, every group is checked, a name no group owns is
refused, and a group's own default (not its class's) is what a change starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from contract.flags import setting
from contract.rules import check_settings, within
from contract.setting_groups import compose, replace


@dataclass(frozen=True)
class Inner:
    size: int = setting(2, help="size", check=within(1, 9))
    name: str = setting("a", help="name")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class Needed:
    path: str = setting("", help="path")

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("needs a path")


@dataclass(frozen=True)
class Shape:
    width: int = setting(1, help="width")
    height: int = setting(1, help="height")


@dataclass(frozen=True)
class Outer:
    needed: Needed
    inner: Inner = field(default_factory=Inner)
    shape: Shape = Shape(width=5)  # a group whose default is not its class's
    top: bool = setting(True, help="top")


def test_compose_routes_each_setting_to_its_group() -> None:
    c = compose(Outer, path="/p", size=3, top=False)
    assert c == Outer(Needed("/p"), Inner(size=3), Shape(width=5), top=False)


def test_a_change_starts_from_the_groups_own_default() -> None:
    assert compose(Outer, path="/p", height=3).shape == Shape(width=5, height=3)


def test_a_group_may_come_whole() -> None:
    assert compose(Outer, path="/p", inner=Inner(name="b")).inner == Inner(name="b")


def test_a_group_without_default_is_built_and_checked() -> None:
    with pytest.raises(ValueError, match="needs a path"):
        compose(Outer)
    with pytest.raises(ValueError, match="size must be in 1..9"):
        compose(Outer, path="/p", size=0)


def test_unknown_names_are_refused_before_anything_is_built() -> None:
    with pytest.raises(TypeError, match="Outer has no setting colour"):
        compose(Outer, colour="red")  # no "needs a path": the name is checked first
    with pytest.raises(TypeError, match="no setting colour"):
        replace(compose(Outer, path="/p"), colour="red")


def test_replace_changes_through_the_groups_and_checks_again() -> None:
    c = compose(Outer, path="/p", name="x")
    d = replace(c, path="/q", top=False)
    assert (d.needed.path, d.inner.name, d.top) == ("/q", "x", False)
    assert c.needed.path == "/p"  # frozen: a new config
    with pytest.raises(ValueError, match="needs a path"):
        replace(c, path="")
