"""Checkpoints as ``trainvitals audit`` reads them: each format by its own library,
every tensor a :class:`TensorRef` read only when the audit reaches it, in chunks.

- a ``torch.save`` dict (``{'model', 'optimizer'}``, ``{'state_dict', ...}``,
  ``{'model_state_dict', 'optimizer_state_dict'}``, a bare state dict) and a Lightning
  ``.ckpt`` (``state_dict``, ``optimizer_states``, ``global_step``):
  ``torch.load(mmap=True, weights_only=True)``, tensors are views of the mapped file;
- a safetensors file (model tensors only): ``safe_open``, read in row slices;
- a Hugging Face Trainer ``checkpoint-N/`` folder: ``model.safetensors`` (or its sharded
  index) or ``pytorch_model.bin``, ``optimizer.pt``, ``trainer_state.json`` for the step;
- a PyTorch distributed checkpoint folder (``.metadata``, as FSDP2 and torchtitan write
  it): ``FileSystemReader`` and its metadata, one ``dcp.load`` per tensor in this one
  process (``no_dist``), whatever the number of ranks that wrote it.

The optimizer's state is keyed by its own parameter ids; :func:`align` names them after
the model's tensors (the groups' ``param_names`` when saved, else the one
order-preserving assignment whose shapes match, else none, with the reason).
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import pickle
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainvitals.errors import ConfigurationError

CHUNK = 1 << 22
"""Elements per chunk a tensor is read and reduced in (16 MB of float32)."""

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
_STEP_KEYS = ("global_step", "step", "iteration", "iter", "num_updates")


class CheckpointError(ConfigurationError):
    """A checkpoint that cannot be read (the message names the file and the problem)."""


@dataclass
class TensorRef:
    """A tensor not read yet: its shape and dtype, and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    """The whole tensor, on the CPU."""
    chunked: Callable[[], Iterator[torch.Tensor]] | None = None
    """Flat pieces of at most about :data:`CHUNK` elements (None: the whole tensor, flattened)."""
    ident: int | None = None
    """For a tensor already in memory (a view of a mapped file): where its storage starts,
    so that tied weights (one tensor under two names) are seen as one."""
    mapped: bool = False
    """A view of a file ``torch.load(mmap=True)`` mapped: each piece's pages are handed
    back (:func:`_release`) once the reader has moved on, so the resident set holds one
    piece of the file at a time, not all of it."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def chunks(self) -> Iterator[torch.Tensor]:
        if self.chunked is not None:
            yield from self.chunked()
            return
        flat = self.read().reshape(-1)
        for a in range(0, flat.numel(), CHUNK):
            piece = flat[a : a + CHUNK]
            yield piece
            if self.mapped:
                _release(piece)


def _held(t: torch.Tensor, mapped: bool = False) -> TensorRef:
    return TensorRef(
        tuple(t.shape),
        t.dtype,
        lambda: t,
        ident=t.data_ptr() if t.numel() else None,
        mapped=mapped and t.is_contiguous(),
    )


_MADV_DONTNEED = 4


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def _release(piece: torch.Tensor) -> None:
    """Drop a read piece of a file mapping from this process's pages (``MADV_DONTNEED``:
    the file is unchanged and a later read maps it again from the page cache). Only for
    the read-only private mapping ``torch.load(mmap=True)`` makes; on Linux only."""
    if not sys.platform.startswith("linux") or piece.numel() == 0:
        return
    start = piece.data_ptr()
    first = start - start % mmap.PAGESIZE
    end = start + piece.numel() * piece.element_size()
    _madvise()(first, end - first, _MADV_DONTNEED)


@dataclass
class Group:
    """One param group: its hyperparameters and its parameters' keys in the state."""

    index: int
    hyper: dict[str, Any]
    params: list[str]
    names: list[str] | None = None
    """The parameters' names as the optimizer saved them (``param_names``), if it did."""

    @property
    def weight_decay(self) -> float:
        wd = self.hyper.get("weight_decay", 0.0)
        return float(wd) if wd is not None else 0.0


@dataclass
class ParamState:
    """One parameter's optimizer state."""

    key: str
    group: int
    step: float | None
    tensors: dict[str, TensorRef]


@dataclass
class OptimizerState:
    groups: list[Group]
    states: dict[str, ParamState]
    names: dict[str, str] = field(default_factory=dict)
    """State key -> model tensor name (empty when they could not be matched)."""
    naming: str = ""
    """How the names were found, or why not."""

    def name(self, key: str) -> str:
        return self.names.get(key, f"optimizer param {key}")


@dataclass
class Checkpoint:
    """One checkpoint, opened: its model tensors and optimizer state, not read yet."""

    path: Path
    format: str
    step: int | None
    step_from: str
    model: dict[str, TensorRef]
    optimizer: OptimizerState | None
    notes: list[str] = field(default_factory=list)
    ordered: bool = True
    """The model's tensors are in definition order (not so in safetensors: sorted keys)."""
    order: list[tuple[str, tuple[int, ...]]] | None = None
    """The model's parameters (name, shape) in definition order, where the file's own
    order is not that (safetensors sorts its keys): from the model's config, when known."""

    @property
    def label(self) -> str:
        return f"{self.path.name} (step {self.step})" if self.step is not None else self.path.name

    @property
    def nbytes(self) -> int:
        n = sum(t.nbytes for t in self.model.values())
        if self.optimizer is not None:
            n += sum(t.nbytes for s in self.optimizer.states.values() for t in s.tensors.values())
        return n


# -- finding the checkpoints ---------------------------------------------------------
def _is_dcp(d: Path) -> bool:
    return (d / ".metadata").is_file()


def _hf_model_file(d: Path) -> Path | None:
    for name in (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ):
        if (d / name).is_file():
            return d / name
    return None


def _is_hf(d: Path) -> bool:
    return (d / "trainer_state.json").is_file() or _hf_model_file(d) is not None


def discover(paths: list[Path]) -> list[Path]:
    """The checkpoints named by ``paths``: files, checkpoint folders, or folders holding
    them (their files with a checkpoint suffix and their checkpoint subfolders)."""
    out: list[Path] = []
    for p in paths:
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or folder")
        if p.is_file() or _is_dcp(p):
            out.append(p)
            continue
        subs = [c for c in sorted(p.iterdir(), key=_natural) if c.is_dir() and (_is_dcp(c) or _is_hf(c))]
        if subs:  # a run's folder (the Trainer's output_dir keeps its final model beside them)
            out.extend(subs)
            continue
        if _is_hf(p):
            out.append(p)
            continue
        found = [
            c
            for c in sorted(p.iterdir(), key=_natural)
            if (c.is_file() and c.name.endswith(_FILE_SUFFIXES)) or (c.is_dir() and (_is_dcp(c) or _is_hf(c)))
        ]
        if not found:
            raise CheckpointError(
                f"{p}: no checkpoint in this folder (files ending {', '.join(_FILE_SUFFIXES)}, "
                "Hugging Face checkpoint-N/ folders, distributed checkpoint folders with a .metadata file)"
            )
        out.extend(found)
    return out


def _natural(p: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _step_from_name(p: Path) -> int | None:
    m = re.search(r"(?:step|global_step|checkpoint|iter|iteration|ckpt)[=_-]?(\d+)", p.name, re.I)
    if m is None:
        m = re.fullmatch(r"\D*(\d+)\D*", p.name)
    return int(m.group(1)) if m else None


def open_checkpoint(path: Path) -> Checkpoint:
    """Open one checkpoint (no tensor is read)."""
    if path.is_dir():
        if _is_dcp(path):
            return _open_dcp(path)
        if _is_hf(path):
            return _open_hf(path)
        raise CheckpointError(f"{path}: a folder that is no checkpoint")
    if path.name.endswith(".safetensors"):
        model, meta = _open_safetensors([path])
        step, source = _meta_step(meta)
        return _finish(Checkpoint(path, "safetensors", step, source, model, None))
    obj = _torch_load(path)
    return _finish(_from_saved_object(path, obj))


def _finish(ck: Checkpoint) -> Checkpoint:
    if ck.step is None:
        step = _step_from_name(ck.path)
        if step is not None:
            ck.step, ck.step_from = step, "the file name"
    if ck.optimizer is not None:
        align(ck.model, ck.optimizer, ck.order, ordered=ck.ordered)
    return ck


def _meta_step(meta: dict[str, str] | None) -> tuple[int | None, str]:
    for k in _STEP_KEYS:
        if meta and k in meta:
            try:
                return int(float(meta[k])), f"the metadata's {k!r}"
            except ValueError:
                continue
    return None, ""


# -- torch.save and Lightning ----------------------------------------------------------
_MAPPED = "__trainvitals_mapped__"
"""Set in a loaded dict whose tensors are views of the mapped file."""


def _torch_load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            if isinstance(obj, dict):
                obj[_MAPPED] = True
            return obj
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"{path}: torch.load(weights_only=True) refuses it ({first}); the audit reads tensors, "
                "dicts and numbers only: save state dicts (model.state_dict(), optimizer.state_dict()), "
                "not modules or other objects"
            ) from None
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise CheckpointError(f"{path}: torch.load cannot read it: {exc}") from None
        # The legacy (non-zip) format cannot be memory-mapped: read whole.
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise CheckpointError(f"{path}: torch.load cannot read it: {exc}") from None
    if isinstance(obj, dict):
        obj.setdefault("__trainvitals_note__", "legacy torch.save format: read whole, not memory-mapped")
    return obj


def _is_state_dict(d: Any) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())


def _is_optimizer_dict(d: Any) -> bool:
    return isinstance(d, dict) and "state" in d and "param_groups" in d


def _from_saved_object(path: Path, obj: Any) -> Checkpoint:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a dict of state dicts or tensors")
    note = obj.pop("__trainvitals_note__", None)
    mapped = bool(obj.pop(_MAPPED, False))
    notes = [note] if isinstance(note, str) else []
    lightning = "optimizer_states" in obj or "pytorch-lightning_version" in obj
    model_sd: Any
    opt_sd: Any
    if _is_state_dict(obj):
        model_sd, opt_sd, fmt = obj, None, "torch.save state dict"
    else:
        model_sd = next(
            (obj[k] for k in ("model", "state_dict", "model_state_dict", "module", "model_state") if k in obj), None
        )
        opt_sd = next((obj[k] for k in ("optimizer", "optimizer_state_dict", "optim") if k in obj), None)
        if opt_sd is None and lightning:
            states = obj.get("optimizer_states") or []
            opt_sd = states[0] if states else None
            if len(states) > 1:
                notes.append(f"{len(states)} optimizers saved: the first is audited")
        if _is_optimizer_dict(obj) and model_sd is None:
            opt_sd = obj
        fmt = "lightning" if lightning else "torch.save"
        if model_sd is not None and not isinstance(model_sd, dict):
            raise CheckpointError(
                f"{path}: its model entry is a {type(model_sd).__name__}, not a state dict of tensors"
            )
        if model_sd is None and opt_sd is None:
            raise CheckpointError(
                f"{path}: no model or optimizer state found (keys: {', '.join(sorted(map(str, obj))[:12])}); "
                "expected 'model', 'state_dict' or 'model_state_dict' and 'optimizer', "
                "'optimizer_state_dict' or Lightning's 'optimizer_states', or a bare state dict"
            )
    model = {k: _held(v, mapped) for k, v in (model_sd or {}).items() if isinstance(v, torch.Tensor)}
    step, source = None, ""
    for k in _STEP_KEYS:
        v = obj.get(k)
        if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
            step, source = int(float(v)), f"its {k!r} entry"
            break
    optimizer = _torch_optimizer(path, opt_sd, mapped) if opt_sd is not None else None
    return Checkpoint(path, fmt, step, source, model, optimizer, notes)


def _number(v: Any) -> float | None:
    if isinstance(v, torch.Tensor):
        return float(v.reshape(-1)[0]) if v.numel() == 1 else None
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _torch_optimizer(path: Path, sd: Any, mapped: bool = False) -> OptimizerState:
    if isinstance(sd, dict):
        mapped = bool(sd.pop(_MAPPED, mapped))
    if not _is_optimizer_dict(sd):
        raise CheckpointError(f"{path}: the optimizer entry is not an optimizer state dict ('state', 'param_groups')")
    groups = []
    for i, g in enumerate(sd["param_groups"]):
        hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        names = g.get("param_names")
        groups.append(Group(i, hyper, [str(p) for p in g.get("params", [])], list(names) if names else None))
    group_of = {p: g.index for g in groups for p in g.params}
    states = {}
    for key, st in sd["state"].items():
        k = str(key)
        tensors = {n: _held(t, mapped) for n, t in st.items() if n in MOMENTS and isinstance(t, torch.Tensor)}
        states[k] = ParamState(k, group_of.get(k, -1), _number(st.get("step")), tensors)
    return OptimizerState(groups, states)


# -- safetensors -----------------------------------------------------------------------
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _open_safetensors(files: list[Path]) -> tuple[dict[str, TensorRef], dict[str, str] | None]:
    from safetensors import SafetensorError, safe_open

    model: dict[str, TensorRef] = {}
    meta: dict[str, str] | None = None
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: safetensors cannot read it: {exc}") from None
        meta = meta or handle.metadata()
        for name in handle.keys():
            sl = handle.get_slice(name)
            shape = tuple(sl.get_shape())
            dtype = _ST_DTYPES.get(sl.get_dtype())
            if dtype is None:
                continue
            model[name] = _safetensors_ref(f, name, shape, dtype)
    return model, meta


def _safetensors_ref(path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorRef:
    def read() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as h:
            tensor: torch.Tensor = h.get_tensor(name)
        return tensor

    return TensorRef(shape, dtype, read, lambda: _row_chunks(path, name, shape, read))


def _row_chunks(
    path: Path, name: str, shape: tuple[int, ...], read: Callable[[], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """A safetensors tensor in slices of whole rows (at least one row per piece), each
    read through a handle of its own: closing it unmaps the file, so the resident set
    holds one piece, not the file."""
    from safetensors import safe_open

    if len(shape) == 0 or math.prod(shape) <= CHUNK:
        yield read().reshape(-1)
        return
    row = math.prod(shape[1:]) or 1
    rows = max(1, CHUNK // row)
    for a in range(0, shape[0], rows):
        with safe_open(str(path), framework="pt", device="cpu") as h:
            piece = h.get_slice(name)[a : a + rows].reshape(-1)
        yield piece


# -- Hugging Face Trainer folder -------------------------------------------------------
def _open_hf(d: Path) -> Checkpoint:
    model_file = _hf_model_file(d)
    model: dict[str, TensorRef] = {}
    notes: list[str] = []
    if model_file is None:
        notes.append("no model file (model.safetensors or pytorch_model.bin)")
    elif model_file.name.endswith(".index.json"):
        try:
            weight_map = json.loads(model_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{model_file}: not a shard index with a weight_map ({exc})") from None
        shards = sorted({d / f for f in weight_map.values()})
        if model_file.name.startswith("model.safetensors"):
            model, _ = _open_safetensors(shards)
        else:
            for s in shards:
                model.update(_from_saved_object(s, _torch_load(s)).model)
    elif model_file.suffix == ".safetensors":
        model, _ = _open_safetensors([model_file])
    else:
        model = _from_saved_object(model_file, _torch_load(model_file)).model
    optimizer = None
    if (d / "optimizer.pt").is_file():
        optimizer = _torch_optimizer(d / "optimizer.pt", _torch_load(d / "optimizer.pt"))
    step, source = None, ""
    state_file = d / "trainer_state.json"
    if state_file.is_file():
        try:
            step, source = int(json.loads(state_file.read_text())["global_step"]), "trainer_state.json"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"trainer_state.json has no global_step ({exc})")
    ck = Checkpoint(d, "hf-trainer", step, source, model, optimizer, notes)
    if model_file is not None and model_file.name.startswith("model.safetensors"):
        ck.ordered = False
        if optimizer is not None:
            ck.order = _config_order(d, notes)
    return _finish(ck)


def _config_order(d: Path, notes: list[str]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The parameters of the model ``config.json`` describes, in definition order, built on
    the meta device (no memory, no weights): what the Trainer's optimizer was built from."""
    if not (d / "config.json").is_file():
        return None
    try:
        import transformers
    except ImportError:
        notes.append("transformers is not installed: the model's parameter order is not known from config.json")
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(str(d))
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch) if arch else None
        if cls is None:
            notes.append(f"config.json names no architecture transformers has ({arch!r})")
            return None
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls(config)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the order unknown, said in a note
        notes.append(f"the model could not be built from config.json ({type(exc).__name__}: {exc})")
        return None
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


# -- torch.distributed.checkpoint ------------------------------------------------------
_DCP_STATE = re.compile(r"^(?P<pre>(?:.*\.)?)state\.(?P<fqn>.+)\.(?P<what>exp_avg|exp_avg_sq|max_exp_avg_sq|step)$")
_DCP_GROUP = re.compile(r"^(?P<pre>(?:.*\.)?)param_groups\.(?P<rest>.+)\.(?P<hp>[A-Za-z_][\w]*)$")


def _open_dcp(d: Path) -> Checkpoint:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class Reader(dcp.FileSystemReader):
        """Reads the metadata once: unpickling it is most of a one-tensor load's time
        (90 ms of 100 for 1,200 entries), and the audit loads tensor by tensor."""

        kept: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if Reader.kept is None:
                Reader.kept = super().read_metadata(*args, **kwargs)
            return Reader.kept

    def load(keys: dict[str, Any]) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(keys, storage_reader=Reader(str(d)), no_dist=True)
        return keys

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            md = Reader(str(d)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to read the metadata is an unreadable checkpoint
        raise CheckpointError(f"{d}: torch.distributed.checkpoint cannot read its .metadata: {exc}") from None

    def pieces(key: str, m: Any) -> Iterator[torch.Tensor]:
        """The tensor as its ranks stored it, one stored chunk at a time (in the order of
        their offsets), each in flat pieces: memory for one stored chunk, not the tensor."""
        if len(m.chunks) <= 1 or len(m.size) <= 1:
            yield from _held(load({key: torch.empty(tuple(m.size), dtype=m.properties.dtype)})[key]).chunks()
            return
        for chunk in sorted(m.chunks, key=lambda c: tuple(c.offsets)):
            got: list[torch.Tensor] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load({}, storage_reader=Reader(str(d)), planner=_ChunkPlanner(key, chunk, m, got), no_dist=True)
            yield from _held(got[0]).chunks()

    def ref(key: str, m: Any) -> TensorRef:
        shape, dtype = tuple(m.size), m.properties.dtype
        return TensorRef(
            shape, dtype, lambda: load({key: torch.empty(shape, dtype=dtype)})[key], lambda: pieces(key, m)
        )

    tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    others = [k for k in md.state_dict_metadata if k not in tensors]
    opt_prefixes: set[str] = set()
    per_param: dict[str, dict[str, TensorRef]] = {}
    steps: dict[str, str] = {}
    for k, m in tensors.items():
        s = _DCP_STATE.match(k)
        if s is None:
            continue
        opt_prefixes.add(s["pre"])
        if s["what"] == "step":
            steps[s["fqn"]] = k
        else:
            per_param.setdefault(s["fqn"], {})[s["what"]] = ref(k, m)
    group_keys = [k for k in others if _DCP_GROUP.match(k) and _DCP_GROUP.match(k)["pre"] in opt_prefixes]  # type: ignore[index]
    step_keys = [
        k
        for k in others + list(tensors)
        if k.rsplit(".", 1)[-1] in _STEP_KEYS and not _DCP_STATE.match(k) and k not in group_keys
    ]
    small = load({k: None for k in group_keys + [k for k in step_keys if k not in tensors]})
    for k in step_keys:
        if k in tensors:
            small[k] = load({k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)})[k]
    counts = load({k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype) for k in steps.values()})
    step_count = {fqn: _number(counts[k]) for fqn, k in steps.items()}

    # param groups: [i].hp with [i].params naming the fqns, or per fqn (flattened)
    by_group: dict[str, dict[str, Any]] = {}
    for k in group_keys:
        g = _DCP_GROUP.match(k)
        assert g is not None
        by_group.setdefault(g["rest"], {})[g["hp"]] = small[k]
    groups: list[Group] = []
    group_of: dict[str, int] = {}
    if by_group and all(r.isdigit() for r in by_group):
        for i, r in enumerate(sorted(by_group, key=int)):
            hyper = dict(by_group[r])
            params = [str(p) for p in hyper.pop("params", []) or []]
            hyper.pop("param_names", None)
            groups.append(Group(i, hyper, params, params))
            group_of.update((p, i) for p in params)
    else:  # flattened: one entry per parameter; parameters with the same hyperparameters form a group
        seen: dict[str, int] = {}
        for fqn, hyper in by_group.items():
            sig = repr(sorted(hyper.items()))
            if sig not in seen:
                seen[sig] = len(groups)
                groups.append(Group(len(groups), dict(hyper), [], []))
            groups[seen[sig]].params.append(fqn)
            groups[seen[sig]].names.append(fqn)  # type: ignore[union-attr]
            group_of[fqn] = seen[sig]
    states = {
        fqn: ParamState(fqn, group_of.get(fqn, -1), step_count.get(fqn), moments) for fqn, moments in per_param.items()
    }
    opt_keys = {k for k in tensors if _DCP_STATE.match(k)}
    model_keys = [k for k in tensors if k not in opt_keys and k not in step_keys]
    model_prefix = "model." if any(k.startswith("model.") for k in model_keys) else ""
    model = {
        k[len(model_prefix) :]: ref(k, tensors[k])
        for k in model_keys
        if k.startswith(model_prefix) and tensors[k].properties.dtype.is_floating_point
    }
    step, source = None, ""
    for k in sorted(step_keys, key=lambda k: (k.count("."), k)):
        n = _number(small.get(k))
        if n is not None:
            step, source = int(n), f"its {k!r} entry"
            break
    optimizer = OptimizerState(groups, states) if states else None
    if optimizer is not None:
        optimizer.names = {fqn: fqn for fqn in states}
        optimizer.naming = "the distributed checkpoint's parameter names"
    ck = Checkpoint(d, "distributed checkpoint", step, source, model, optimizer)
    if ck.step is None:
        s2 = _step_from_name(d)
        if s2 is not None:
            ck.step, ck.step_from = s2, "the folder name"
    return ck


def _chunk_planner_base() -> type:
    """torch.distributed.checkpoint's planner class, imported only when the module is (some
    builds of torch have no torch.distributed)."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    return LoadPlanner


class _ChunkPlanner(_chunk_planner_base()):  # type: ignore[misc]
    """A load plan of one stored chunk of one tensor (torch.distributed.checkpoint's
    ``LoadPlanner`` interface): it is read into a tensor of its own size, handed to
    ``got``, and nothing else is read."""

    def __init__(self, key: str, chunk: Any, meta: Any, got: list[torch.Tensor]) -> None:
        self.key, self.chunk, self.meta, self.got = key, chunk, meta, got

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        offsets = torch.Size(self.chunk.offsets)
        zeros = torch.Size([0] * len(offsets))
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(self.key, offsets),
            dest_offsets=zeros,
            storage_index=MetadataIndex(self.key, offsets),
            storage_offsets=zeros,
            lengths=torch.Size(self.chunk.sizes),
        )
        return LoadPlan([item])

    def create_global_plan(self, global_plan: Any) -> Any:
        return global_plan

    def finish_plan(self, central_plan: Any) -> Any:
        return central_plan

    def load_bytes(self, read_item: Any, value: Any) -> None:
        pass

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        t = torch.empty(tuple(self.chunk.sizes), dtype=self.meta.properties.dtype)
        self.got.append(t)
        return t

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass


# -- naming the optimizer's parameters -------------------------------------------------
_MAX_STATES = 4096


def _by_unique_shapes(cands: list[tuple[str, tuple[int, ...]]], opt: OptimizerState) -> bool:
    """Name every optimizer parameter whose shape is held by exactly one model tensor
    and one optimizer parameter; True when that names them all."""
    keys = [p for g in opt.groups for p in g.params]
    shape_of = {
        p: tuple(opt.states[p].tensors["exp_avg"].shape)
        if p in opt.states and "exp_avg" in opt.states[p].tensors
        else None
        for p in keys
    }
    if any(s is None for s in shape_of.values()):
        return False
    model_count: dict[Any, list[str]] = {}
    for n, shape in cands:
        model_count.setdefault(shape, []).append(n)
    opt_count: dict[Any, int] = {}
    for s in shape_of.values():
        opt_count[s] = opt_count.get(s, 0) + 1
    if any(opt_count[s] != 1 or len(model_count.get(s, [])) != 1 for s in shape_of.values()):
        return False
    opt.names = {p: model_count[s][0] for p, s in shape_of.items()}
    return True


def align(
    model: dict[str, TensorRef],
    opt: OptimizerState,
    order: list[tuple[str, tuple[int, ...]]] | None = None,
    *,
    ordered: bool = True,
) -> None:
    """Name the optimizer's parameters after the model's tensors, in place. ``order``:
    the parameters in definition order when known apart from the file; ``ordered``:
    whether the file's own order is the definition order (safetensors sorts its keys)."""
    if all(g.names is not None and len(g.names) == len(g.params) for g in opt.groups) and opt.groups:
        opt.names = {p: n for g in opt.groups for p, n in zip(g.params, g.names or [], strict=True)}
        opt.naming = "the param groups' saved param_names"
        return
    if not model:
        opt.naming = "not matched to names: the checkpoint has no model tensors"
        return
    # The model's parameters in their order (buffers and integer tensors left out).
    seen: set[tuple[int, tuple[int, ...]]] = set()
    cands = list(order or [])
    if order is None:
        for n, t in model.items():
            if not t.dtype.is_floating_point or n.rsplit(".", 1)[-1] in _BUFFERS:
                continue
            if t.ident is not None:  # a tied weight's second name: the optimizer holds it once
                if (t.ident, t.shape) in seen:
                    continue
                seen.add((t.ident, t.shape))
            cands.append((n, t.shape))
    if not ordered and order is None:
        if _by_unique_shapes(cands, opt):
            opt.naming = "matched to the model's tensors by shape (each shape held by one parameter)"
        else:
            opt.naming = (
                "not matched to names: the model file does not keep the parameters' order and their shapes "
                "repeat (a config.json that transformers can build gives the order)"
            )
        return
    seqs = [
        [
            tuple(opt.states[p].tensors["exp_avg"].shape)
            if p in opt.states and "exp_avg" in opt.states[p].tensors
            else None
            for p in g.params
        ]
        for g in opt.groups
    ]
    total = sum(len(s) for s in seqs)
    if total > len(cands):
        opt.naming = f"not matched to names: the optimizer has {total} parameters, the model {len(cands)} tensors"
        return
    skip = total < len(cands)
    # Forward over the model's tensors: each state is the position reached in every group,
    # with how many assignments lead there (2: more than one).
    k = len(seqs)
    frontier: dict[tuple[int, ...], tuple[int, tuple[Any, ...] | None]] = {(0,) * k: (1, None)}
    for name, shape in cands:
        nxt: dict[tuple[int, ...], tuple[int, tuple[Any, ...] | None]] = {}
        for pos, (count, trail) in frontier.items():
            moves = [g for g in range(k) if pos[g] < len(seqs[g]) and seqs[g][pos[g]] in (None, shape)]
            for g in moves:
                new = (*pos[:g], pos[g] + 1, *pos[g + 1 :])
                c0, t0 = nxt.get(new, (0, None))
                nxt[new] = (min(2, c0 + count), t0 if t0 is not None else (trail, g, name))
            if skip:
                c0, t0 = nxt.get(pos, (0, None))
                nxt[pos] = (min(2, c0 + count), t0 if t0 is not None else trail)
        frontier = nxt
        if len(frontier) > _MAX_STATES:
            opt.naming = "not matched to names: too many ways to match the optimizer's parameters to the model's"
            return
    end = tuple(len(s) for s in seqs)
    count, trail = frontier.get(end, (0, None))
    if count == 0:
        opt.naming = "not matched to names: no order of the model's tensors has the optimizer's shapes"
        return
    if count > 1:
        opt.naming = (
            "not matched to names: tensors of the same shape could be any of several parameters "
            "(save the optimizer with named parameters, or its param groups' param_names)"
        )
        return
    assigned: list[tuple[int, str]] = []
    while trail is not None:
        trail, g, name = trail
        assigned.append((g, name))
    assigned.reverse()
    taken = [0] * k
    for g, name in assigned:
        opt.names[opt.groups[g].params[taken[g]]] = name
        taken[g] += 1
    opt.naming = "matched to the model's tensors by order and shape"
