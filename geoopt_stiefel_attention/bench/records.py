"""What a benchmark returns and writes: the timing of one timed entry, the machine it ran on, the JSON
document."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from typing import Any


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class ArmTiming:
    """Step time of one arm: median and quartiles over every timed step (milliseconds)."""

    arm: str
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


def to_json(results: list[Any], machine: Machine, **meta: Any) -> str:
    """JSON document with the machine, the run's settings and every result."""
    return json.dumps({"machine": asdict(machine), "settings": meta, "results": [asdict(r) for r in results]},
                      indent=2, default=str)

