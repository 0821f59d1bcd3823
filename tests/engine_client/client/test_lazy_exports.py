"""The lazy loader of public names (`client/lazy_exports.py`) and the client package's table:
a name loads from its module on first use, a table entry naming a submodule is that module, an
unknown name is an AttributeError, and every name the package exports resolves."""

from __future__ import annotations

import os.path

import pytest

import engine_client.client as client
from engine_client.client.lazy_exports import lazy_attribute

TABLE = {"join": "os.path", "path": "os.path"}


def test_a_name_comes_from_its_module_and_a_submodule_is_itself() -> None:
    assert lazy_attribute("pkg", TABLE, "join") is os.path.join
    assert lazy_attribute("pkg", TABLE, "path") is os.path


def test_an_unknown_name_is_an_attribute_error_naming_the_package() -> None:
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'nothing'"):
        lazy_attribute("pkg", TABLE, "nothing")


def test_every_public_name_of_the_client_package_resolves() -> None:
    for name in client.__all__:
        assert getattr(client, name) is not None, name
    with pytest.raises(AttributeError):
        client.NoSuchName  # noqa: B018
