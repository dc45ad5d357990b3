"""The JSON file the GPU scripts write with --json: the GPU's name, torch's version and the records."""

from __future__ import annotations

import json

import torch


def write_records(path: str | None, records: list) -> None:
    """{"gpu", "torch", "records"} into `path`; nothing when path is None."""
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f,
                      indent=1)
