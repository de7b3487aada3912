"""Malformed NATS payloads for the fuzz in ``tests.chaos.nats_fuzz``: the generic battery, cases built
from a verb's request type field by field, and the guard that keeps a case from being a valid command.

What a verb takes comes from the project's own request Structs (``VERBS``, keyed by the micro
service's name and the endpoint's name as ``$SRV.INFO`` reports them). A case sent to a verb that
changes the deployment (sleep, restart, spawn, escalate, ...) must *fail* to decode against that
verb's type here first: a payload that decodes is a command the verb could carry out, so it is
skipped and counted, never sent.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from types import UnionType
from typing import Any, Union, get_args, get_origin

import msgspec

from actors.kv.contract import KvDumpRequest, KvRangeRequest, RouterKvEvent
from actors.planner.contract import DecisionsRequest, Demand, ProfileRequest, WakeOutcome
from actors.router.service import DumpRequest, FinishRequest, RouteRequest
from actors.worker import contract as C
from bus import codec
from bus import subjects as S
from supervisors.service import ChildRef, EscalateRequest, SpawnRequest, StopRequest

DEPTH = 100_000  # nested arrays: ~200 KB, far past any recursion limit, far below max_payload
HUGE_STR = 1 << 20  # 1 MiB, top level
# "Near max_payload": a request this many bytes below the server's limit, so that a reply or an
# error header quoting it, with any text around the quote, goes over the limit.
HEADROOM = 32
MSGPACK = {S.CONTENT_TYPE: S.CT_MSGPACK}
_DEEP = "\x00fuzz-deep\x00"  # stands for DEPTH nested arrays in a field value (spliced in as bytes)


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Verb:
    """What one endpoint takes. ``request`` None: any payload (a read-only verb that ignores it)."""

    request: Any = None
    mutating: bool = False  # a valid request changes the deployment: only undecodable cases are sent
    allow_empty: bool = True  # the Endpoint's allow_empty (False: an empty payload is a 400)
    streaming: bool = False  # replies with the bus/stream.py protocol
    skeleton: dict[str, Any] | None = None  # a valid request field cases are merged into (read-only verbs)


_GENERATE = Verb(C.GenerateRequest, streaming=True,
                 skeleton={"token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}})
_ANY = Verb()

# (service name, endpoint name) -> Verb, for every endpoint a deployment serves; "*" = any service.
VERBS: dict[tuple[str, str], Verb] = {
    ("*", "cancel"): _ANY,  # a stream's cancel: any payload is a request id (none is live)
    ("supervisor", "children"): _ANY,
    ("supervisor", "restart"): Verb(ChildRef, mutating=True),
    ("supervisor", "spawn"): Verb(SpawnRequest, mutating=True),
    ("supervisor", "stop"): Verb(StopRequest, mutating=True),
    ("supervisor", "escalate"): Verb(EscalateRequest, mutating=True),
    ("engine", "generate"): _GENERATE,
    ("engine", "generate_instance"): _GENERATE,
    ("engine", "sleep"): Verb(C.SleepRequest, mutating=True, allow_empty=False),
    ("engine", "wake_up"): Verb(C.WakeUpRequest, mutating=True, allow_empty=False),
    ("engine", "clear_kv_blocks"): Verb(C.ClearKvBlocksRequest, mutating=True, allow_empty=False),
    ("engine", "health"): _ANY,
    ("engine", "stats"): _ANY,
    ("engine", "lora_add"): Verb(C.EngineLoraAdd, mutating=True, allow_empty=False),
    ("engine", "lora_remove"): Verb(C.EngineLoraRemove, mutating=True, allow_empty=False),
    ("engine", "lora_list"): _ANY,
    ("engine", "kv_sources"): _ANY,
    ("lora", "lora_load"): Verb(C.LoraLoadRequest, mutating=True, allow_empty=False),
    ("lora", "lora_unload"): Verb(C.LoraUnloadRequest, mutating=True, allow_empty=False),
    ("lora", "lora_list"): _ANY,
    ("health", "liveness"): _ANY,
    ("kv_publisher", "kv_dump"): Verb(KvDumpRequest),
    ("kv_publisher", "kv_range"): Verb(KvRangeRequest),
    ("frontend", "status"): _ANY,
    ("frontend", "route"): Verb(RouteRequest, mutating=True, allow_empty=False),  # may book load
    ("frontend", "finish"): Verb(FinishRequest, mutating=True, allow_empty=False),
    ("frontend", "index_stats"): _ANY,
    ("frontend", "index_dump"): Verb(DumpRequest),
    ("planner", "status"): _ANY,
    ("planner", "decisions"): Verb(DecisionsRequest),
    ("planner", "profile"): Verb(ProfileRequest),
    ("waker", "status"): _ANY,
}
SRV_VERB = _ANY  # $SRV.PING|INFO|STATS.<name>.<id>: the payload is ignored
# Published, never requested (no reply by design). A valid event or load report for a made-up
# worker would change what the router believes, so they count as mutating: only garbage is sent.
KV_EVENT_VERB = Verb(RouterKvEvent, mutating=True)
LOAD_VERB = Verb(C.LoadReport, mutating=True)
# cold models: a valid demand wakes a pool, a valid failed outcome ends a frontend's held requests
DEMAND_VERB = Verb(Demand, mutating=True)
WAKE_OUTCOME_VERB = Verb(WakeOutcome, mutating=True)
UNKNOWN_VERB = Verb(mutating=True)  # an endpoint VERBS does not know: only undecodable bytes


def verb_for(service: str, endpoint: str) -> Verb | None:
    return VERBS.get((service, endpoint)) or VERBS.get(("*", endpoint))


# --- the generic battery ---------------------------------------------------------------------------
def generic_cases(rng: random.Random, max_payload: int) -> list[Case]:
    """Malformed input of every kind, the same for every subject."""
    deep_mp = b"\x91" * DEPTH + b"\x90"
    near_max = max_payload - HEADROOM
    return [
        Case("empty", b""),
        Case("random_64", rng.randbytes(64)),
        Case("random_4k", rng.randbytes(4096)),
        Case("nul_bytes", b"\x00" * 16),
        Case("invalid_utf8", b"\xff\xfe\xfd\x80"),
        Case("invalid_utf8_in_string", b'{"fuzz": "\xff\xfe"}'),
        Case("invalid_utf8_in_key", b'{"\xc3\x28": 1}'),
        Case("overlong_utf8", b'{"fuzz": "\xc0\xaf"}'),
        Case("lone_surrogate_escape", b'{"fuzz": "\\ud800"}'),
        Case("deep_arrays", b"[" * DEPTH + b"]" * DEPTH),
        Case("deep_objects", b'{"a":' * (DEPTH // 2) + b"1" + b"}" * (DEPTH // 2)),
        Case("deep_unclosed", b"[" * DEPTH),
        Case("huge_int", b"9" * 5000),
        Case("huge_int_in_object", b'{"fuzz": ' + b"9" * 5000 + b"}"),
        Case("huge_float", b"1e99999"),
        Case("nan_literal", b'{"fuzz": NaN}'),
        Case("huge_string", json.dumps("x" * HUGE_STR).encode()),
        Case("near_max_string", json.dumps("x" * (near_max - 2)).encode()),
        Case("near_max_raw", b"r" * near_max),
        Case("control_chars", b'{"fuzz": "a\\r\\nInjected: 1\\r\\n\\r\\n\\u0000\\u001b[2J"}'),
        Case("null", b"null"),
        Case("wrong_shape_array", b"[1, 2, 3]"),
        Case("wrong_shape_string", b'"fuzz"'),
        Case("wrong_shape_number", b"42"),
        Case("wrong_shape_bool", b"true"),
        Case("truncated", b'{"fuzz": [1, 2'),
        Case("trailing_garbage", b'{"fuzz": 1} }}'),
        Case("bom_prefixed", b'\xef\xbb\xbf{"fuzz_unknown_field": 1}'),
        Case("unknown_fields", b'{"fuzz_unknown_field": 1, "another_unknown": {"x": [1, null]}}'),
        Case("unknown_content_type", b'{"fuzz_unknown_field": 1}', {S.CONTENT_TYPE: "application/xml"}),
        Case("msgpack_random", rng.randbytes(256), MSGPACK),
        Case("msgpack_truncated", b"\x82\xa1a", MSGPACK),
        Case("msgpack_invalid_utf8", b"\x81\xa1a\xa2\xff\xfe", MSGPACK),
        Case("msgpack_deep", deep_mp, MSGPACK),
        Case("msgpack_ext", b"\xd4\x01\x00", MSGPACK),
        Case("msgpack_wrong_shape", msgspec.msgpack.encode([1, 2, 3]), MSGPACK),
        Case("msgpack_huge_len", b"\xdd\xff\xff\xff\xff", MSGPACK),  # array32 claiming 4G items
        Case("msgpack_json_body", b'{"fuzz_unknown_field": 1}', MSGPACK),
        Case("msgpack_empty", b"", MSGPACK),
    ]


def mutated_cases(rng: random.Random, base: bytes, n: int) -> list[Case]:
    """``n`` seeded byte-level mutations (flip, insert, delete, splice) of ``base``."""
    out = []
    for i in range(n):
        b = bytearray(base or b"{}")
        for _ in range(rng.randint(1, 4)):
            op, pos = rng.randrange(4), rng.randrange(len(b) + 1)
            if op == 0 and pos < len(b):
                b[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                b[pos:pos] = bytes([rng.choice(b'{}[]",:\\\x00\xff0-9e')])
            elif op == 2 and pos < len(b):
                del b[pos]
            else:
                b[pos:pos] = rng.randbytes(rng.randint(1, 8))
        out.append(Case(f"mutation_{i}", bytes(b)))
    return out


# --- cases from a request type ---------------------------------------------------------------------
def field_cases(verb: Verb, max_payload: int) -> list[Case]:
    """Per field of the verb's request type (one level into nested Structs): a wrong type, null,
    huge numbers, a string near max_payload (a reply quoting it goes over) or with control
    characters, and deep nesting, wherever the field's type makes it a distinct case. Read-only
    verbs with a skeleton get each value inside an otherwise valid request."""
    t = verb.request
    if not _is_struct(t):
        return []
    out = []
    for path, ftype, required in _fields(t):
        name = ".".join(path)
        values: list[tuple[str, Any]] = []
        wrong = _wrong_value(ftype)
        if wrong is not None:
            values.append(("wrong_type", wrong))
        if required or not _accepts(ftype, None):
            values.append(("null", None))
        if _accepts(ftype, 7):
            values += [("huge_int", 10**40), ("int64_overflow", 2**63), ("uint64_max", 2**64 - 1)]
        if _accepts(ftype, [7]):
            values.append(("huge_int_list", [10**40, -(10**40)]))
        if _accepts(ftype, 1.5):
            values.append(("huge_float", 1e308))
        if _accepts(ftype, "x"):
            values.append(("control_chars", "a\r\nInjected: 1\r\n\r\n\x00\x1b"))
            # JSON only: one near-max_payload string per field is enough
            envelope = len(_payload(verb, path, "") or b"")
            out.append(Case(f"huge_string:{name}", _payload(verb, path, "x" * (max_payload - HEADROOM - envelope))))
        if _accepts(ftype, {"k": [1]}) or _accepts(ftype, [[1]]):
            values.append(("deep", _DEEP))
        for kind, value in values:
            out.append(Case(f"{kind}:{name}", _payload(verb, path, value)))
            packed = _payload(verb, path, value, msgpack=True)
            if packed is not None:  # the same field in msgpack, as the frontend sends generate requests
                out.append(Case(f"msgpack_{kind}:{name}", packed, MSGPACK))
    return out


def header_cases(verb: Verb) -> list[Case]:
    """A streaming verb's valid request with garbage protocol headers (the stall timeout sets the
    responder's heartbeat; the request id keys its cancels)."""
    if not verb.streaming or verb.skeleton is None:
        return []
    body = json.dumps(verb.skeleton).encode()
    cases = [Case(f"stall_timeout:{v}", body, {S.STALL_TIMEOUT: v}) for v in ("nan", "inf", "-1", "0", "fuzz")]
    cases.append(Case("request_id:huge", body, {S.REQUEST_ID: "r" * 4096}))
    cases.append(Case("request_id:spaces", body, {S.REQUEST_ID: " \t fuzz id "}))
    return cases


def is_valid_command(verb: Verb, case: Case) -> bool:
    """True when the case decodes as the verb's request: for a mutating verb it could be obeyed.
    Decoding goes through the project's own codec, as the endpoints do; whatever it raises (a
    BadRequest, or on an unfixed codec a RecursionError) means the verb cannot act on the case."""
    if verb.request is None and not case.data:
        return verb.allow_empty
    try:
        codec.decode(case.data, case.headers, verb.request, allow_empty=verb.allow_empty)
    except Exception:
        return False
    return True


def valid_empty_object(verb: Verb) -> bool:
    """Does ``{}`` alone make a valid request of this verb (it then acts with its defaults)?"""
    return verb.request is not None and is_valid_command(verb, Case("{}", b"{}"))


# --- helpers -------------------------------------------------------------------------------------
def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _fields(t: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any, bool]]:
    out = []
    for f in msgspec.structs.fields(t):
        path = (*prefix, f.encode_name)
        out.append((path, f.type, f.required))
        nested = [a for a in (get_args(f.type) if _is_union(f.type) else (f.type,)) if _is_struct(a)]
        if nested and not prefix:
            out += _fields(nested[0], path)
    return out


def _is_union(t: Any) -> bool:
    return get_origin(t) in (Union, UnionType)


def _accepts(ftype: Any, value: Any) -> bool:
    try:
        msgspec.convert(value, ftype)
    except (msgspec.ValidationError, TypeError):
        return False
    return True


def _wrong_value(ftype: Any) -> Any:
    for v in ({"fuzz": 1}, "fuzz", [1], 1.5, True):
        if not _accepts(ftype, v):
            return v
    return None  # takes anything (Any)


def _payload(verb: Verb, path: tuple[str, ...], value: Any, msgpack: bool = False) -> bytes | None:
    """The request with ``value`` at ``path``; None where msgpack cannot carry the value."""
    obj: dict[str, Any] = json.loads(json.dumps(verb.skeleton)) if verb.skeleton and not verb.mutating else {}
    node = obj
    for key in path[:-1]:
        child = node.get(key)
        node[key] = child = child if isinstance(child, dict) else {}
        node = child
    node[path[-1]] = value
    if msgpack:
        try:
            data = msgspec.msgpack.encode(obj)
        except OverflowError:  # integers past 64 bits
            return None
        deep, nested = msgspec.msgpack.encode(_DEEP), b"\x91" * DEPTH + b"\x90"
    else:
        data = json.dumps(obj).encode()
        deep, nested = json.dumps(_DEEP).encode(), b"[" * DEPTH + b"]" * DEPTH
    return data.replace(deep, nested) if deep in data else data
