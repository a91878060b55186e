"""``--help``: the flag list rendered by tyro from the config dataclasses and their docstrings.

tyro is used for nothing else (flags are parsed by :mod:`torchtitan.config.cli`), so it is
imported only when help is asked for.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torchtitan.config.values import parse_nested, split_commas

__all__ = ["DESCRIPTION", "print_help"]

DESCRIPTION = (
    "Resolve a torchtitan JobConfig: defaults < TOML (--job.config_file FILE, or "
    "--module M --config NAME for a bundled config) < flags. Booleans are actions "
    "(--x.flag / --x.no_flag); lists take one comma-separated value (a,b); None sets "
    "an optional field to None. Tool-only flag: --json prints JSON instead of TOML."
)


def _registry() -> Any:
    """tyro constructors so list flags show our syntax: ``A,B,...`` and ``A,B;C or JSON``."""
    import json

    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec

    registry = ConstructorRegistry()

    def list_rule(item: type) -> Any:
        return PrimitiveConstructorSpec(
            nargs=1,
            metavar="A,B,...",
            instance_from_str=lambda args: [item(s) for s in split_commas(args[0])],
            is_instance=lambda v: isinstance(v, list) and all(isinstance(i, item) for i in v),
            str_from_instance=lambda v: [",".join(str(i) for i in v)],
        )

    @registry.primitive_rule
    def _comma_lists(info: Any) -> Any:
        for item in (str, int, float):
            if info.type == list[item]:
                return list_rule(item)
        if info.type == list[list[str]]:
            return PrimitiveConstructorSpec(
                nargs=1,
                metavar="A,B;C or JSON",
                instance_from_str=lambda args: parse_nested(args[0]),
                is_instance=lambda v: isinstance(v, list) and all(isinstance(p, list) for p in v),
                str_from_instance=lambda v: [json.dumps(v)],
            )
        return None

    return registry


def print_help(cls: type, defaults: Any, prog: str | None) -> NoReturn:
    """Print every flag of ``cls`` (defaults shown from ``defaults``) and exit 0."""
    import tyro

    tyro.cli(
        cls,
        default=defaults,
        args=["--help"],
        registry=_registry(),
        use_underscores=True,
        prog=prog,
        description=DESCRIPTION,
    )
    raise SystemExit(0)  # pragma: no cover - tyro exits after printing help
