"""What one worker process may do on the bus (``bus.scoped_workers``): the publish and subscribe
permissions of the user its root issues it, derived from what the process serves and sends.

Listed from the code and from a trace of a worker's connection (nats-server -DV) serving the
secure mocker deployment: its actors' endpoints, its registry keys, its KV events and load reports,
the JetStream calls its registry needs, its own inbox. Everything else, another worker's verbs and
request subjects, any supervisor's but its own, stream deletes and purges, the deployment's other
replies, is a permissions violation. A subject this list forgets shows as one in the worker's log
(``nats ...: permissions violation``), which the secure e2e test checks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.subjects import (
    JS_API_INFO,
    SRV_ALL,
    Subjects,
    inbox_prefix,
    js_consumer_create,
    js_direct_get,
    js_msg_get,
    js_stream_create,
    js_stream_info,
    kv_key,
    kv_stream,
    queue_permission,
)

REPLIES = "_INBOX.>"  # every reply subject (bus.subjects.inbox_prefix and clients' defaults)
QUEUE = "q"  # the queue group of load-balanced endpoints (bus.micro.EndpointSpec's default)
# the kinds and instance names of the actors a worker process runs beside its engine actor
# (actors.worker.health.HealthMonitor, kv_publisher.KvPublisherActor, lora_actor.LoraActor)
HEALTH_KIND, KV_PUBLISHER_KIND, LORA_KIND = "health", "kv_publisher", "lora"


def health_instance(instance: str) -> str:
    return f"health-{instance}"


def kv_publisher_instance(instance: str) -> str:
    return f"{instance}-kvpub"


def lora_instance(instance: str) -> str:
    return f"{instance}-lora"


@dataclass(frozen=True)
class WorkerScope:
    publish: list[str]
    subscribe: list[str]


def worker_scope(namespace: str, pool: str, instance: str, host: str, node: str,
                 model: str | None) -> WorkerScope:
    """The permissions of worker ``instance`` of ``pool`` on ``host``, whose supervisor is ``node``
    (its root child id) and whose model card is ``model``'s."""
    sj = Subjects(namespace)
    buckets = {"instances": sj.bucket_instances, "models": sj.bucket_models, "loras": sj.bucket_loras}
    # its actors' cancel endpoints (the engine actor's is under ns.worker.<instance>)
    cancels = [sj.actor(HEALTH_KIND, health_instance(instance), "cancel"),
               sj.actor(KV_PUBLISHER_KIND, kv_publisher_instance(instance), "cancel"),
               sj.actor(LORA_KIND, lora_instance(instance), "cancel")]
    own = [sj.worker(instance, ">"), sj.generate_instance(pool, instance), sj.kv_index(instance, ">"),
           sj.supervisor_node(host, node, ">")]
    registry = [kv_key(buckets["instances"], k) for k in
                (instance, kv_publisher_instance(instance), health_instance(instance), lora_instance(instance))]
    if model:
        registry.append(kv_key(buckets["models"], f"{model}.{pool}"))  # its pool's card
    registry.append(kv_key(buckets["loras"], f"{instance}.>"))  # the adapters it loaded
    loras = kv_stream(buckets["loras"])
    jetstream = [js_stream_info(kv_stream(b)) for b in buckets.values()]
    # a worker may be the first to need a registry bucket (a host of workers only, its frontend's
    # host not up yet): it creates it as bus.registry does; updating or deleting one it may not
    jetstream += [js_stream_create(kv_stream(b)) for b in buckets.values()]
    jetstream.append(JS_API_INFO)  # nats-py asks the account's JetStream level before a create
    # a restarted LoRA manager reads the bucket back (stream state and each key's last message)
    jetstream += [js_msg_get(loras), js_direct_get(loras), *js_consumer_create(loras)]
    publish = [
        # replies to its callers: the deployment's processes (_INBOX.<ns>...), and operators' tools,
        # whose inboxes are nats-py's and the CLI's default (_INBOX.<random>): `nats micro ls`,
        # `nats req ... health`. A reply subject is unguessable; what it may not do is read them
        REPLIES,
        *own, sj.kv_events(instance), sj.load(instance), *registry, *jetstream,
    ]
    subscribe = [
        f"{inbox_prefix(namespace, instance)}.>",  # its own replies only
        SRV_ALL,  # micro-service discovery ($SRV.PING/INFO/STATS): answered, never read for others
        queue_permission(sj.generate(pool), QUEUE),  # its pool's share of requests, never a copy of all
        *own, *cancels,
    ]
    return WorkerScope(publish=publish, subscribe=subscribe)
