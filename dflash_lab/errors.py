"""One error type for every bad input, so command lines can print one line and exit 2."""


class LabError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message
