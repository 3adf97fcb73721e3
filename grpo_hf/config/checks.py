"""The checks every section of `GRPOConfig` runs: a setting among its allowed values, a value in
its range, a dict-valued setting given as a dict. Each raises a ValueError naming the setting."""

from collections.abc import Iterable


def check_choices(settings: object, choices: Iterable[tuple[str, tuple]]) -> None:
    """An error for the first (name, allowed values) whose setting is not one of them."""
    for name, allowed in choices:
        if getattr(settings, name) not in allowed:
            raise ValueError(
                f"{name}={getattr(settings, name)!r} is not one of {allowed}; set {name} to one of them."
            )


def check_ranges(checks: Iterable[tuple[bool, str]]) -> None:
    """An error with the message of the first (ok, message) that is not ok."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message + ".")


def check_dicts(settings: object, names: Iterable[str]) -> None:
    """An error for the first of these settings that is neither None nor a dict (the command line and
    YAML configs turn a JSON object string into a dict before this)."""
    for name in names:
        if not isinstance(getattr(settings, name), dict | None):
            raise ValueError(
                f"{name}={getattr(settings, name)!r} is not a dict; pass a dict, or a JSON object string "
                "('{\"key\": value}') on the command line."
            )
