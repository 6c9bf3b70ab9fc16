"""Weight files for ``update_weights`` (see ``turnrl.types.WeightUpdatable``): reading a checkpoint
folder's, and writing the one a push hands to servers.

``update_weights`` takes either a state dict (in-process engines apply it directly) or the
path of a saved Hugging Face checkpoint folder (servers load it from their own disk; an
in-process engine reads its safetensors files with ``load_state_dict``).

``write_safetensors`` writes a push's file in place: a push after a training step rewrites the
same file, the same size, over pages the last push already made (in ``/dev/shm`` a new file costs
a page fault per page, which with ``safetensors``' own writer, to a new file or truncating the old
one, was most of a push's write).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch dtype names -> safetensors' (the format's dtype strings)
_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's ``*.safetensors`` files (or of one such file), on CPU."""
    from safetensors.torch import load_file

    root = Path(path)
    files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (save it with save_pretrained)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """Write ``tensors`` (on any device, in any layout) as one safetensors file at ``path``, in place.

    The bytes are those of the safetensors format (an 8-byte little-endian header length, the JSON
    header padded to 8 bytes, then each tensor's raw bytes); ``safetensors.torch.load_file`` reads
    them back. An existing file is overwritten without truncating first and cut to the new length
    after, so a file of the same size keeps its pages. Nothing may read the file meanwhile (a
    server reads it only when told to reload, after this returns). A dtype the format lacks raises
    ValueError.
    """
    import torch

    # widest dtypes first (as safetensors does): every tensor's bytes start aligned to its dtype
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in ordered:
        dtype = _DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out = Path(path)
    with open(out, "r+b" if out.is_file() else "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, tensor in ordered:  # one at a time onto the CPU: the host never holds a second model
            if tensor.numel():
                f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.truncate()
    return out
