"""The base every config section derives from, and one-line validation messages naming the key path."""

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    """Unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; the example configs spell every key)"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid config {source}: " + "; ".join(parts)
