"""What a benchmark returns and writes: the timing of one timed entry, the machine it ran on, the code it ran
(git commit, format version), the JSON document."""

from __future__ import annotations

import json
import platform
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Timing:
    """Step time of what one benchmark entry ``name`` times: an optimizer (``bench step``), a path of the
    StiefelAdam step (``bench paths``) or a study arm, model preparation plus optimizer (``bench train``); the
    median and quartiles over every timed step (milliseconds).

    Written to JSON by :func:`as_record`, which keeps the file format's key ``"arm"`` for ``name``.

    Attributes
    ----------
    name : str
        The entry timed (optimizer, path or arm).
    median_ms, q1_ms, q3_ms : float
        Median, first and third quartile of the step times, in milliseconds (NaN when the entry did not run).
    steps : int
        Timed steps, over every round (0 when the entry did not run).
    state_bytes : int or None
        Bytes of the optimizer's state after the run; ``None`` where no optimizer was timed.
    workspace_bytes : int or None
        Bytes of the optimizer's step workspaces; ``None`` when it keeps none.
    note : str
        Why the entry is missing or flagged; empty otherwise.
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
    """Where a benchmark ran.

    Attributes
    ----------
    cpu : str
        CPU model (from ``/proc/cpuinfo`` where available), and the GPU's name on a CUDA device.
    logical_cpus : int
        ``os.cpu_count()``.
    torch_threads : int
        ``torch.get_num_threads()`` when it was described.
    torch, geoopt, python : str
        Versions.
    platform : str
        ``platform.platform()``.
    device : str
        Torch device of the benchmark.
    extra : dict of str to str
        Further facts, empty by default.
    """

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
    """Describe the machine and library versions (the model name from ``/proc/cpuinfo`` where available).

    Parameters
    ----------
    device : str, default "cpu"
        Torch device of the benchmark (a ``cuda`` device adds its GPU's name to ``cpu``).

    Returns
    -------
    Machine
        The description.
    """
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
    """A result object (its :class:`Timing` entries included) as the JSON-ready dict the files hold.

    Parameters
    ----------
    result : dataclass instance
        A :class:`StepTimeResult`, :class:`StepPathResult` or :class:`TrainStepResult`.

    Returns
    -------
    dict
        Its fields, a :class:`Timing`'s ``name`` under the key ``"arm"``.
    """
    return asdict(result, dict_factory=_file_dict)


def to_json(results: list[Any], machine: Machine, **meta: Any) -> str:
    """JSON document with the provenance (:func:`provenance`), the machine, the run's settings and every result.

    Parameters
    ----------
    results : list
        Result objects, each written by :func:`as_record`.
    machine : Machine
        Where they ran (:func:`machine_info`).
    **meta
        The run's settings, written under ``"settings"``.

    Returns
    -------
    str
        The JSON document (indented by 2).
    """
    return json.dumps({**provenance(), "machine": asdict(machine), "settings": meta,
                       "results": [as_record(r) for r in results]}, indent=2, default=str)


# ----------------------------------------------------------------------------------------------- provenance
#: Version of the JSON documents that ``stiefel-attention bench`` writes (``--out``, ``--json``; every benchmark,
#: ``gpu`` and ``muon`` included). Version 1 is every file written before the field existed (the committed
#: ``benchmarks/results/*.json`` among them): no provenance. Version 2 adds, at the top level, ``format_version``,
#: ``git_commit``, ``git_dirty`` and ``geoopt_stiefel_attention`` (:func:`provenance`); the rest is unchanged, so
#: a reader of version 1 reads version 2.
BENCH_FORMAT_VERSION = 2

#: What :func:`read_provenance` gives for a version-1 document, which records none of it.
_VERSION_1_PROVENANCE = {"format_version": 1, "git_commit": "unknown", "git_dirty": None,
                         "geoopt_stiefel_attention": None}

#: Uncommitted changes that do not make a checkout dirty: the committed study records (``experiments/<study>/
#: records/``), which studies write while they train, as for the studies' own ``environment.json``.
_NOT_CODE = ":(top,exclude,glob)experiments/*/records/**"


def _git(root: Path, *args: str) -> str | None:
    """``git -C root *args``'s output, ``None`` when git is missing, fails or takes over 10 s."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(root: str | Path | None = None) -> tuple[str, bool | None]:
    """The git commit of the checkout the library runs from, and whether it has uncommitted changes.

    Parameters
    ----------
    root : str or Path, optional
        The folder to ask; default: the folder that holds the ``geoopt_stiefel_attention`` package. It counts as a
        checkout only when it is the top level of a git work tree (an installed package inside some other
        repository is not that repository's code).

    Returns
    -------
    commit : str
        The full SHA of ``HEAD``, or ``"unknown"`` when ``root`` is not the top of a git checkout with a commit
        (an installed wheel, no ``git`` on the machine).
    dirty : bool or None
        Whether tracked files differ from ``HEAD`` (untracked files and the study records under
        ``experiments/*/records/`` aside); ``None`` when ``commit`` is ``"unknown"``.
    """
    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
    top = _git(root, "rev-parse", "--show-toplevel")
    sha = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}") if top is not None else None
    if not sha or Path(top).resolve() != root.resolve():
        return "unknown", None
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ":(top)", _NOT_CODE)
    return sha, None if status is None else bool(status)


def provenance() -> dict[str, Any]:
    """The fields that say what code wrote a benchmark document (format :data:`BENCH_FORMAT_VERSION`).

    Returns
    -------
    dict
        ``format_version`` (:data:`BENCH_FORMAT_VERSION`), ``git_commit`` and ``git_dirty`` (:func:`git_state`)
        and ``geoopt_stiefel_attention`` (the library's version, the only provenance of an installed wheel).
    """
    from .. import __version__

    commit, dirty = git_state()
    return {"format_version": BENCH_FORMAT_VERSION, "git_commit": commit, "git_dirty": dirty,
            "geoopt_stiefel_attention": __version__}


def read_provenance(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of a benchmark JSON document of any version, keyed as :func:`provenance`.

    Parameters
    ----------
    doc : mapping
        A document as ``json.load`` reads it from a ``--out`` file.

    Returns
    -------
    dict
        Its ``format_version``, ``git_commit``, ``git_dirty`` and ``geoopt_stiefel_attention``; a version-1
        document (no ``format_version``, written before provenance was recorded) gives version 1, ``"unknown"``,
        ``None`` and ``None``.

    Raises
    ------
    ValueError
        When ``doc`` is not a JSON object, its ``format_version`` is not an int from 1 to
        :data:`BENCH_FORMAT_VERSION` (a file of a newer library, or not a benchmark document), or a document of
        version 2 or later lacks one of the fields.
    """
    if not isinstance(doc, Mapping):
        raise ValueError(f"read_provenance: doc is a {type(doc).__name__}, not a benchmark document (a JSON "
                         f"object); pass the object json.load reads from a bench --out file.")
    version = doc.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= BENCH_FORMAT_VERSION:
        raise ValueError(f"read_provenance: format_version={version!r} is not a benchmark format this library "
                         f"reads (1 to {BENCH_FORMAT_VERSION}); read the file with the library version that wrote "
                         f"it, or upgrade geoopt_stiefel_attention.")
    if version == 1:
        return dict(_VERSION_1_PROVENANCE)
    missing = [key for key in _VERSION_1_PROVENANCE if key not in doc]
    if missing:
        raise ValueError(f"read_provenance: a format_version={version} document must hold {', '.join(missing)}, "
                         f"and this one does not (edited by hand, or not written by bench); rewrite it with "
                         f"stiefel-attention bench --out.")
    return {key: doc[key] for key in _VERSION_1_PROVENANCE}

