"""The IR's exception types, named by role."""


class IRError(ValueError):
    """A malformed graph, node or type; the message names the node and says what is wrong."""


class ParseError(IRError):
    """Text that is not valid megagraph IR; carries the line number."""

    def __init__(self, message: str, line_no: int | None = None, line: str | None = None):
        where = f" (line {line_no}: {line.strip()!r})" if line_no is not None else ""
        super().__init__(message + where)
        self.line_no = line_no
