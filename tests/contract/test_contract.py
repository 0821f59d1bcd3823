"""The contract package imports neither side nor gRPC, the pools are plain Python, and both
sides name the same error classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT)},
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "statement",
    ["import contract.errors", "import kv_service.books.pool", "import kv_service.core"],
)
def test_domain_modules_import_no_grpc_and_no_side(statement: str) -> None:
    modules = imported_after(statement)
    assert not {m for m in modules if m == "grpc" or m.startswith("grpc.")}
    if statement.startswith("import contract"):
        assert not {m for m in modules if m.split(".")[0] in ("kv_service", "engine_client")}


def test_every_error_class_is_imported_from_where_it_is_defined() -> None:
    """Both sides raise the same classes because both import them from contract/errors.py: no
    module of ours re-exports one (`from x import CapacityError` names contract.errors), and the
    client library's public `errors` is that module itself."""
    import ast

    import contract.errors as c
    from engine_client.client import errors as client

    classes = {
        name for name, v in vars(c).items() if isinstance(v, type) and issubclass(v, c.KVError)
    }
    wrong = []
    for package in ("kv_service", "engine_client", "transport", "contract"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module != "contract.errors":
                    wrong += [
                        f"{path.name}: {a.name} from {node.module}"
                        for a in node.names
                        if a.name in classes
                    ]
    assert not wrong
    assert client is c
    for alias in ("KVClientError", "ServiceError", "WrongEpoch", "Unavailable"):
        assert not hasattr(c, alias)
    assert len(set(c.BY_REASON)) == len(c.BY_REASON) and c.BY_REASON["DRAINING"] is c.Draining


def test_one_status_table_both_ways() -> None:
    """Every class's code (service side) decodes back to that class or, for a subclass the table
    does not list, to its nearest listed ancestor (client side, without an ErrorInfo)."""
    import grpc

    import contract.errors as c
    from engine_client.client import status as client
    from transport.status import code_for

    for cls in c.BY_REASON.values():
        code = code_for(cls)
        assert code.name == c.status_code_name(cls)
        back = client.from_status(code, "x")
        assert isinstance(back, c.class_of_status(code.name)) and issubclass(cls, type(back))
        assert client.code_of(cls("x")) is code
    assert type(client.from_status(grpc.StatusCode.CANCELLED, "x")) is c.ServiceUnavailable
    assert client.from_status(grpc.StatusCode.DATA_LOSS, "x").status is grpc.StatusCode.DATA_LOSS
    assert code_for(ValueError) is grpc.StatusCode.INTERNAL
    assert client.code_of(ValueError()) is grpc.StatusCode.UNKNOWN


def test_never_fits_is_one_rule_both_ways() -> None:
    """A permanent capacity error is sent as the contract's NEVER_FITS_CODE (the service's
    status_of, the client's code_of) and read back as permanent from that code, even without
    the `permanent` detail; a temporary one keeps the table's RESOURCE_EXHAUSTED."""
    import grpc

    import contract.errors as c
    from engine_client.client import status as client
    from transport.status import status_of

    never, later = c.CapacityError("x", permanent=True), c.CapacityError("x")
    assert status_of(never).code is client.code_of(never) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(later).code is client.code_of(later) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(never).reason == status_of(later).reason == "CAPACITY_EXHAUSTED"
    back = client.from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", {}, "CAPACITY_EXHAUSTED")
    assert type(back) is c.CapacityError and back.permanent and back.details == {}
    again = client.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", {}, "CAPACITY_EXHAUSTED")
    assert type(again) is c.CapacityError and not again.permanent


def test_prefixed_keeps_class_details_and_permanence() -> None:
    from contract.errors import CapacityError

    err = CapacityError("no pages", permanent=True, pages_needed=9).prefixed("admit")
    assert type(err) is CapacityError and err.permanent and err.details == {"pages_needed": "9"}
    assert str(err) == "admit: no pages (pages_needed=9)"
