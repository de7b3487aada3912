"""A client's prompt embeddings, decoded and checked once for the frontend and the worker.

The wire form is vLLM's (``CompletionRequest.prompt_embeds``, the reference backend's too): base64 of
``torch.save(tensor)``, the tensor (num_tokens, hidden_size) or (1, num_tokens, hidden_size) of any
floating dtype. The rules are vLLM's ``safe_load_prompt_embeds`` (``weights_only`` load, squeeze of a
batch of one, the model's hidden size, floating point only) with bounds vLLM leaves out, because the
frontend decodes what any client sends before it routes anything:

- the base64 text is measured before it is decoded: a model with C positions of hidden size H never
  needs more than C x H float64 values, so a longer payload is refused without a byte decoded;
- only ``torch.save``'s zip format, every entry stored (not compressed) and no entry declared larger
  than the archive. torch's zip reader allocates what an entry declares and inflates deflated entries,
  so a small crafted archive could otherwise claim gigabytes; its legacy (non-zip) format allocates
  storages of the size its pickle claims before reading them;
- dense tensors only: a sparse tensor can describe a dense size far beyond its bytes.

Every refusal is a ``LimitError`` naming ``prompt_embeds``, the frontend's and the worker's 400;
``EmbedsTooLarge`` (a payload over the cap) is their 413.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import zipfile
from typing import TYPE_CHECKING, Final

from actors.engines.limits import LimitError

if TYPE_CHECKING:
    import torch

PARAM: Final = "prompt_embeds"
# Absolute bound on one tensor's base64 text, whatever the model: the worker request that carries it
# must fit the embedded bus's 8 MiB max_payload (bus.embedded.MAX_PAYLOAD) with the rest of the request.
MAX_EMBEDS_B64: Final = 7 << 20
# What torch.save adds around the raw values: the pickle, the entry names, 64-byte alignment padding.
_ARCHIVE_OVERHEAD: Final = 64 << 10
_MAX_ELEMENT_BYTES: Final = 8  # float64, the widest floating dtype a client may send
_ZIP_MAGIC: Final = b"PK\x03\x04"  # what torch.load looks for to pick its zip reader
_REASON_CHARS: Final = 200  # torch's reason is built from the client's bytes: bounded, not echoed whole


class EmbedsTooLarge(LimitError):
    """The base64 text is longer than any tensor this model can take could need."""


def b64_cap(max_rows: int | None, hidden_size: int | None) -> int:
    """The longest base64 text a tensor of at most ``max_rows`` x ``hidden_size`` values can need."""
    if not max_rows or not hidden_size:
        return MAX_EMBEDS_B64
    raw = max_rows * hidden_size * _MAX_ELEMENT_BYTES + _ARCHIVE_OVERHEAD
    return min(MAX_EMBEDS_B64, 4 * math.ceil(raw / 3))


def _reason(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= _REASON_CHARS else f"{text[:_REASON_CHARS]}... ({len(text) - _REASON_CHARS} more characters)"


def _check_archive(raw: bytes) -> None:
    """torch.save's zip, every entry stored and within the archive's size (see the module doc)."""
    if not raw.startswith(_ZIP_MAGIC):
        raise LimitError("`prompt_embeds` must be a tensor written by torch.save (its zip format); got "
                         + ("no data" if not raw else "other data"), PARAM)
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            entries = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise LimitError(f"`prompt_embeds` is not a readable torch.save archive: {_reason(e)}", PARAM) from None
    declared = 0
    for info in entries:
        if info.compress_type != zipfile.ZIP_STORED:
            raise LimitError("`prompt_embeds` archive has a compressed entry; torch.save writes "
                             "uncompressed ones", PARAM)
        declared += info.file_size
    if declared > len(raw):
        raise LimitError("`prompt_embeds` archive declares more data than it holds", PARAM)


def decode_embeds(data: str | bytes, *, hidden_size: int | None, max_rows: int | None = None) -> torch.Tensor:
    """base64 of ``torch.save(tensor)`` → the (num_tokens, hidden_size) tensor, as sent (dtype kept:
    the engine casts to the model's). ``hidden_size`` None: not checked (unknown);
    ``max_rows`` (the model's context length) bounds the payload before anything is decoded."""
    cap = b64_cap(max_rows, hidden_size)
    if len(data) > cap:
        raise EmbedsTooLarge(f"`prompt_embeds` is too large: {len(data)} base64 characters, at most {cap} "
                             f"for this model (its context length x hidden size, as float64, within the bus's "
                             f"message size). torch.save writes a view's whole storage: save a copy "
                             f"(tensor.clone())", PARAM)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise LimitError(f"`prompt_embeds` is not valid base64: {e}", PARAM) from None
    _check_archive(raw)
    import torch  # lazy: a worker without prompt embeddings never pays for it

    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except MemoryError:
        raise  # the server's condition, not the client's
    except Exception as e:  # noqa: BLE001 - torch has no one error type for "not a tensor file"
        raise LimitError(f"`prompt_embeds` could not be deserialized as a torch tensor: {_reason(e)}",
                         PARAM) from None
    if not isinstance(tensor, torch.Tensor):
        raise LimitError(f"`prompt_embeds` must hold a tensor, got {type(tensor).__name__}", PARAM)
    if tensor.layout != torch.strided:
        raise LimitError(f"`prompt_embeds` must be a dense tensor, got layout {tensor.layout}", PARAM)
    if tensor.dim() == 3 and tensor.shape[0] == 1:  # a batch of one: vLLM squeezes it too
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise LimitError("`prompt_embeds` must be a 2-D tensor of shape (num_tokens, hidden_size); got "
                         f"shape {tuple(tensor.shape)}", PARAM)
    if tensor.shape[0] == 0:
        raise LimitError("`prompt_embeds` has no rows (num_tokens = 0)", PARAM)
    if hidden_size is not None and tensor.shape[1] != hidden_size:
        raise LimitError(f"`prompt_embeds` hidden_size {tensor.shape[1]} does not match the model's "
                         f"hidden_size {hidden_size}", PARAM)
    if not tensor.is_floating_point():
        raise LimitError(f"`prompt_embeds` dtype {tensor.dtype} is not a floating-point type", PARAM)
    return tensor
