"""Adapters on the wire: a whole adapter as ONE Flower Array (plus a small manifest), not one per tensor.

Flower 1.42 moves a message as content-addressed objects, one per Array (and its chunks), each
hashed and sent with its own call from ClientApp to SuperNode to SuperLink and back. A SmolLM2
LoRA adapter is 420 tensors of a few KB to 50 KB: as 420 Arrays, every round's three transfers per
edge cost the SuperLink and the SuperNodes tens of CPU-seconds (measured in collm-bench: up to
two thirds of a core for a minute per round, on the cores the edges serve from). Packed, a
message is a couple of objects and the bytes are the same.

`pack` concatenates the float32 tensors in key order into one flat Array and stores the keys and
shapes as JSON in a uint8 Array next to it; `unpack` reverses it, and also takes a record keyed by
tensor name (what older edges, tests and checkpoints hold), so both sides accept either form.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord

PACKED = "collm.packed"  # the flat float32 values
MANIFEST = "collm.manifest"  # JSON [[key, shape], ...] as uint8, in the order of PACKED


def pack(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """One ArrayRecord holding every tensor of `arrays` (float32) in two Arrays (empty stays empty:
    round 1's 'no global yet')."""
    if not arrays:
        return ArrayRecord()
    keys = list(arrays)
    flat = [np.asarray(arrays[k], np.float32).reshape(-1) for k in keys]
    manifest = json.dumps([[k, list(np.shape(arrays[k]))] for k in keys]).encode()
    values = np.concatenate(flat)
    return ArrayRecord({PACKED: Array(values), MANIFEST: Array(np.frombuffer(manifest, np.uint8).copy())})


def pack_record(record: ArrayRecord) -> ArrayRecord:
    return pack({k: v.numpy() for k, v in record.items()})


def is_packed(record: ArrayRecord) -> bool:
    return PACKED in record and MANIFEST in record


def unpack(record: ArrayRecord) -> dict[str, np.ndarray]:
    """key -> float tensor of a packed record (or of one keyed by tensor name); ValueError, and nothing else, for
    anything malformed: what an edge sends is not trusted (a nested manifest, strings, objects, bad sizes)."""
    try:
        out = _unpack(record)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - RecursionError, TypeError, ...: one kind of refusal for the caller
        raise ValueError(f"packed adapter: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    for k, v in out.items():
        if not isinstance(v, np.ndarray) or not (np.issubdtype(v.dtype, np.floating) or
                                                 np.issubdtype(v.dtype, np.integer)):
            kind = v.dtype if isinstance(v, np.ndarray) else type(v).__name__
            raise ValueError(f"adapter tensor {k[:100]!r}: {kind}, expected numbers")
    return out


def _unpack(record: ArrayRecord) -> dict[str, np.ndarray]:
    if not is_packed(record):
        return {str(k): v.numpy() for k, v in record.items()}
    try:
        manifest = json.loads(record[MANIFEST].numpy().tobytes().decode())
        entries = [(str(k), tuple(int(d) for d in shape)) for k, shape in manifest]
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"packed adapter: unreadable manifest ({e})") from None
    if any(d < 0 for _, shape in entries for d in shape):
        raise ValueError("packed adapter: a negative dimension in the manifest")
    values = record[PACKED].numpy().reshape(-1)
    sizes = [int(np.prod(shape, dtype=np.int64)) if shape else 1 for _, shape in entries]
    if sum(sizes) != values.size:
        raise ValueError(f"packed adapter: the manifest describes {sum(sizes)} values, the array holds "
                         f"{values.size}")
    out, at = {}, 0
    for (k, shape), n in zip(entries, sizes, strict=True):
        out[k] = values[at:at + n].reshape(shape)
        at += n
    return out


def unpack_record(record: ArrayRecord) -> ArrayRecord:
    """The keyed ArrayRecord of a packed one (Flower's aggregation averages tensor by tensor)."""
    if not is_packed(record):
        return record
    return keyed(unpack(record))


def keyed(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord with one Array per tensor (what Flower's aggregation averages)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
