"""Why a backend cannot run a call: stable reason codes and the error that lists them."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence


class ReasonCode(str, enum.Enum):
    """Stable codes for code and tests; the human detail lives in `Reason.message`."""

    DEVICE = "device"
    CAPABILITY = "capability"
    DTYPE = "dtype"
    HEAD_DIM = "head_dim"
    SEQ_LEN = "seq_len"
    MASK = "mask"
    DROPOUT = "dropout"
    GQA = "gqa"
    LAYOUT = "layout"
    GRAD = "grad"
    DISABLED_BY_USER = "disabled_by_user"
    NOT_INSTALLED = "not_installed"
    COMPILE_FAILED = "compile_failed"
    SLOWER = "slower"  # eligible, but a measured-faster backend runs instead (default order only)


@dataclasses.dataclass(frozen=True)
class Reason:
    code: ReasonCode
    message: str

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"


class BackendUnsupportedError(NotImplementedError):
    """No allowed backend can run the call. Subclass of RuntimeError (via NotImplementedError).

    `rejected` maps each backend name to every reason it gave, xFormers style.
    """

    def __init__(self, what: str, rejected: Mapping[str, Sequence[Reason]]):
        self.rejected = {name: tuple(reasons) for name, reasons in rejected.items()}
        lines = [f"No backend can run {what}:"]
        for name, reasons in self.rejected.items():
            lines.append(f"  `{name}` is not supported because:")
            lines.extend(f"    {r}" for r in reasons)
        super().__init__("\n".join(lines))
