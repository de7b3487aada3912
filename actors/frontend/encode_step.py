"""E/P/D's encode step of a completion (no HTTP, no NATS): an encode worker runs the vision encoder
on the prompt's images, and the outputs travel with the request to the prefill (or agg) worker,
whose engine loads them instead of encoding.

Best effort by design: when no encode worker can do it, the request goes on without outputs and
the prefill/agg engine encodes the images itself (same output, more work there). A decode worker
never needs the outputs: it gets the images' KV from the prefill worker.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec

from actors.engines.protocol import MultiModalInput
from actors.worker.contract import EncodeReply, EncodeRequest

from .discovery import ModelEntry, Worker, WorkerSet
from .routing import Router

log = logging.getLogger(__name__)


class EncodeLink(Protocol):
    async def encode(self, worker: Worker, req: EncodeRequest) -> EncodeReply: ...


async def encode_images(mm: MultiModalInput, token_ids: list[int], *, model: ModelEntry, request_id: str,
                        attempts: int, workers: WorkerSet, router: Router, link: EncodeLink,
                        retry_on: tuple[type[BaseException], ...]) -> MultiModalInput:
    """``mm`` with each image's encoder output from an encode worker of ``model``. A worker that
    fails with one of ``retry_on`` is replaced by another, ``attempts`` times at most; after that,
    or with no encode worker at all, ``mm`` comes back as it was."""
    rid = f"{request_id}-e"
    failed: set[str] = set()
    while True:
        pool = [w for w in workers.workers(model.name, "encode") if w.instance not in failed]
        if not pool or len(failed) > attempts:
            log.warning("request %s: no encode worker could encode its images; the %s worker encodes them",
                        request_id, "prefill" if model.has_prefill_pool else "serving")
            return mm
        worker = router.choose(pool, None, failed, request_id=rid)
        try:
            reply = await link.encode(worker, EncodeRequest(request_id=rid, token_ids=list(token_ids), mm=mm))
            break
        except retry_on as e:
            failed.add(worker.instance)
            log.warning("encode on %s failed (%s); trying another encode worker", worker.instance, e)
        finally:
            router.finished(rid)
    outputs = {o.uuid: o.encoder_output for o in reply.outputs}
    log.debug("request %s: %d image(s) encoded on %s", request_id, len(outputs), worker.instance)
    return with_outputs(mm, outputs)


def with_outputs(mm: MultiModalInput, outputs: dict[str, bytes | None]) -> MultiModalInput:
    """``mm`` with each image's encoder output from ``outputs`` (by image id; None: none)."""
    return msgspec.structs.replace(mm, images=[msgspec.structs.replace(img, encoder_output=outputs.get(img.uuid))
                                               for img in mm.images])
