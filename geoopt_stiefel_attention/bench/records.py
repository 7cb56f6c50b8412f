"""What a benchmark returns and writes: the timing of one timed entry, the machine it ran on, the JSON
document."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field, fields
from typing import Any


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Timing:
    """Step time of what one benchmark entry ``name`` times: an optimizer (``bench step``), a path of the
    StiefelAdam step (``bench paths``) or a study arm, model preparation plus optimizer (``bench train``); the
    median and quartiles over every timed step (milliseconds).

    Written to JSON by :func:`as_record`, which keeps the file format's key ``"arm"`` for ``name``.
    """

    name: str
    median_ms: float
    q1_ms: float
    q3_ms: float
    steps: int
    state_bytes: int | None = None
    workspace_bytes: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Machine:
    """Where a benchmark ran."""

    cpu: str
    logical_cpus: int
    torch_threads: int
    torch: str
    geoopt: str
    python: str
    platform: str
    device: str
    extra: dict[str, str] = field(default_factory=dict)


def machine_info(device: str = "cpu") -> Machine:
    """Describe the machine and library versions (the model name from ``/proc/cpuinfo`` where available)."""
    import os

    import geoopt
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        cpu = f"{cpu}; GPU {torch.cuda.get_device_name(torch.device(device))}"
    return Machine(cpu=cpu, logical_cpus=os.cpu_count() or 0, torch_threads=torch.get_num_threads(),
                   torch=torch.__version__, geoopt=geoopt.__version__, python=platform.python_version(),
                   platform=platform.platform(), device=device)


#: The key under which a :class:`Timing`'s ``name`` is written. The JSON documents are a stable file format
#: (``benchmarks/results/*.json``, the accelerator check's file, and whoever reads them), written when bench still
#: called what it times an "arm": they keep that key, so that old and new files read alike.
_FILE_KEYS = {"name": "arm"}
_TIMING_FIELDS = tuple(f.name for f in fields(Timing))


def _file_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``dataclasses.asdict``'s ``dict_factory``: a :class:`Timing`'s fields under their file keys."""
    if tuple(key for key, _ in pairs) == _TIMING_FIELDS:
        return {_FILE_KEYS.get(key, key): value for key, value in pairs}
    return dict(pairs)


def as_record(result: Any) -> dict[str, Any]:
    """A result object (its :class:`Timing` entries included) as the JSON-ready dict the files hold."""
    return asdict(result, dict_factory=_file_dict)


def to_json(results: list[Any], machine: Machine, **meta: Any) -> str:
    """JSON document with the machine, the run's settings and every result."""
    return json.dumps({"machine": asdict(machine), "settings": meta, "results": [as_record(r) for r in results]},
                      indent=2, default=str)

