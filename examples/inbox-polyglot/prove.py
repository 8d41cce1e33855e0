"""The inbox, proven from other languages (issue 24; run by scripts/inbox-polyglot.sh).

The `outbox` relay publishes events that this script writes into an outbox table with plain SQL
(any language can produce, too) to RabbitMQ and to Kafka. Consumers in other languages read
them and apply one effect per event through the inbox's claim function:

  - `billing` on one RabbitMQ queue, shared by a Python consumer (pika + psycopg) and a Node
    consumer (amqplib + pg): a message one of them gave up on goes to either;
  - `shipping` on a Kafka topic, a Python consumer (confluent-kafka + psycopg).

Duplicates are injected every way a real system makes them: consumers are killed between the
commit and the ack and started again (the broker redelivers, or the offset was never
committed); some events fail after their effect was written, once, and are delivered again
(the rollback must undo the claim, or the effect would be lost); every event is sent a second
time (`outbox replay`); and two transactions race on one claim directly. A message without an
event id is parked. Then: every event's effect exactly once per handler, nothing from a
rolled-back producer transaction, the inbox holding one row per effect (`outbox inbox status`),
the parked message listed (`outbox inbox parked`). Last, the Order system's billing service
written in Python (crates/outbox-orders/python) charges and refunds orders delivered over NATS
JetStream, killed between commit and ack and sent every event twice. Any violation: exit 1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pika
import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

HERE = Path(__file__).resolve().parent
FAILURES = []


def say(message):
    print(f"inbox-polyglot: {message}", flush=True)


def check(ok, message):
    if ok:
        say(f"ok   {message}")
    else:
        say(f"FAIL {message}")
        FAILURES.append(message)


def wait_for(what, limit, done, supervisor=None):
    deadline = time.monotonic() + limit
    while not done():
        if supervisor:
            supervisor.assert_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit}s waiting for {what}")
        time.sleep(0.1)


class Supervisor:
    """Runs the relay and the consumers; starts a consumer again when it exits with 3 (the
    injected crash between commit and ack), counting the restarts."""

    def __init__(self, logdir):
        self.logdir = Path(logdir)
        self.procs = {}
        self.restarts = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.broken = None

    def start(self, name, argv, restart_on_crash=False):
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with self.lock:
            self.procs[name] = (proc, argv, restart_on_crash)
            self.restarts.setdefault(name, 0)
        if restart_on_crash:
            threading.Thread(target=self._watch, args=(name,), daemon=True).start()

    def _watch(self, name):
        while True:
            with self.lock:
                proc, argv, _ = self.procs[name]
            code = proc.wait()
            if self.stopping:
                return
            if code != 3:
                self.broken = f"{name} exited with {code} (log: {self.logdir / name}.log)"
                return
            with self.lock:
                self.restarts[name] += 1
            self.start_again(name, argv)

    def start_again(self, name, argv):
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with self.lock:
            self.procs[name] = (proc, argv, True)

    def assert_alive(self):
        if self.broken:
            raise RuntimeError(self.broken)
        for name, (proc, _, restart) in list(self.procs.items()):
            if not restart and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} (log: {self.logdir / name}.log)")

    def stop(self):
        self.stopping = True
        with self.lock:
            procs = [p for p, _, _ in self.procs.values()]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def race(dsn, claim):
    """Two transactions claim one event: the second waits for the first, then sees its outcome."""
    for first_ends, expected in (("commit", False), ("rollback", True)):
        a = psycopg.connect(dsn)
        b = psycopg.connect(dsn)
        event_id = uuid.uuid4()
        first = a.execute(claim, (event_id, "race")).fetchone()[0]
        answer = {}

        def second():
            answer["fresh"] = b.execute(claim, (event_id, "race")).fetchone()[0]
            b.commit()

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        waited = t.is_alive()
        getattr(a, first_ends)()
        t.join(10)
        check(first is True and waited and answer.get("fresh") is expected,
              f"race: the second claim waited for the first transaction and answered {expected} after its {first_ends}")
        a.close()
        b.close()


def outbox(binary, *argv):
    out = subprocess.run([binary, *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"outbox {' '.join(argv)} exited {out.returncode}: {out.stderr}")
    return out.stdout


def orders_example(args, tag, workdir):
    """The worked example's billing service written in Python (crates/outbox-orders/python), fed by
    the relay over NATS JetStream: every order charged once and every cancellation refunded
    once, with the service killed between commit and ack and every event replayed."""
    import asyncio

    import nats

    repo = HERE.parent.parent
    schema = f"outbox_t_polyorders_{tag}"
    stream, prefix = f"OUTBOX_T_POLY_{tag}", f"poly{tag}"
    config = workdir / "orders.toml"
    config.write_text(f"""
[database]
url = "{args.dsn}"
schema = "{schema}"

[relay]
poll_interval = "50ms"

[retention]
enabled = false

[destinations.orders]
type = "nats"
servers = ["{args.nats_url}"]
subject = "{prefix}.orders.${{event_type}}"
create_stream = true
stream_name = "{stream}"
stream_subjects = ["{prefix}.orders.>"]

[inbox]
schema = "{schema}"
table = "inbox"
""")
    outbox(args.outbox, "migrate", "--config", str(config))
    outbox(args.outbox, "inbox", "migrate", "--config", str(config))
    orders, cancelled = {}, set()
    insert = (f'INSERT INTO "{schema}".events (id, aggregate_type, aggregate_id, event_type, payload) '
              "VALUES (%s, 'order', %s, %s, %s)")
    with psycopg.connect(args.dsn) as db:
        for i in range(60):
            order_id = str(uuid.uuid4())
            amount = 100 * (i + 1) + 7
            orders[order_id] = amount
            with db.transaction():
                db.execute(insert, (uuid.uuid4(), order_id, "OrderCreated", json.dumps({
                    "order_id": order_id, "product": f"lamp {i}", "quantity": 1 + i % 3, "customer": None,
                    "amount_cents": amount, "created_at": "2026-11-25T12:00:00Z"})))
            if i % 4 == 1:
                with db.transaction():
                    db.execute(insert, (uuid.uuid4(), order_id, "OrderCancelled", json.dumps({
                        "order_id": order_id, "amount_cents": amount, "cancelled_at": "2026-11-25T12:01:00Z"})))
                cancelled.add(order_id)

    def ledger():
        with psycopg.connect(args.dsn) as db:
            try:
                return db.execute(f'SELECT order_id, action, value FROM "{schema}".billing_ledger').fetchall()
            except psycopg.errors.UndefinedTable:
                return []  # the service creates it when it starts

    def undelivered():
        with psycopg.connect(args.dsn) as db:
            return db.execute(f'SELECT count(*) FROM "{schema}".events WHERE status <> %s',
                              ("delivered",)).fetchone()[0]

    async def pending():
        nc = await nats.connect(args.nats_url)
        try:
            info = await nc.jetstream().consumer_info(stream, "billing-py")
            return info.num_pending + info.num_ack_pending
        finally:
            await nc.close()

    sup = Supervisor(workdir)
    try:
        sup.start("orders-relay", [args.outbox, "relay", "--config", str(config)])
        sup.start("billing-service.py", [sys.executable, str(repo / "crates/outbox-orders/python/billing_service.py"),
                                         "--database-url", args.dsn, "--schema", schema, "--nats-url", args.nats_url,
                                         "--stream", stream, "--subjects", f"{prefix}.orders.>",
                                         "--crash-every", "25", "--ack-wait", "2"], restart_on_crash=True)
        expected = len(orders) + len(cancelled)
        wait_for("every charge and refund", 60, lambda: len(ledger()) >= expected and undelivered() == 0, sup)
        outbox(args.outbox, "replay", "--config", str(config), "--from", "1h")
        wait_for("the replayed order events", 60, lambda: undelivered() == 0, sup)
        wait_for("billing-service.py to ack every message", 60, lambda: asyncio.run(pending()) == 0, sup)
        restarts = sup.restarts.get("billing-service.py", 0)
    finally:
        sup.stop()
    rows = ledger()
    charges = [(o, v) for o, a, v in rows if a == "charge"]
    refunds = [(o, v) for o, a, v in rows if a == "refund"]
    check(sorted(charges) == sorted(orders.items()),
          f"orders example, Python billing over NATS: {len(charges)} charges for {len(orders)} orders, each once")
    check(sorted(refunds) == sorted((o, orders[o]) for o in cancelled),
          f"orders example, Python billing over NATS: {len(refunds)} refunds for {len(cancelled)} cancellations, each once")
    check(restarts > 0, f"orders example: billing-service.py killed between commit and ack {restarts} times")
    if not FAILURES and not args.keep:
        with psycopg.connect(args.dsn, autocommit=True) as db:
            db.execute(f'DROP SCHEMA "{schema}" CASCADE')

        async def drop():
            nc = await nats.connect(args.nats_url)
            try:
                await nc.jetstream().delete_stream(stream)
            finally:
                await nc.close()

        asyncio.run(drop())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outbox", required=True, help="the outbox binary")
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/%2f")
    p.add_argument("--kafka-brokers", default="127.0.0.1:19092")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--node", default="node")
    p.add_argument("--events", type=int, default=150, help="events per broker")
    p.add_argument("--break-claim", action="store_true",
                   help="consumers ignore the claim's answer: the proof must then fail")
    p.add_argument("--keep", action="store_true", help="keep the schema, queue and topic")
    args = p.parse_args()
    started = time.monotonic()
    tag = f"{os.getpid()}_{int(time.time()) % 100000}"
    schema = f"outbox_t_poly_{tag}"
    exchange, queue, topic = f"outbox_t_poly_{tag}", f"outbox_t_poly_{tag}_billing", f"outbox_t_poly_{tag}"
    workdir = Path(tempfile.mkdtemp(prefix="inbox-polyglot-"))
    say(f"schema {schema}, logs in {workdir}")

    # --- the outbox and the inbox, both created by the outbox binary ------------------------
    config = workdir / "outbox.toml"
    config.write_text(f"""
[database]
url = "{args.dsn}"
schema = "{schema}"

[relay]
batch_size = 100
poll_interval = "50ms"

[retention]
enabled = false

[destinations.rabbit]
type = "rabbitmq"
url = "{args.amqp_url.replace('guest:guest@', '')}"
exchange = "{exchange}"
routing_key = "${{event_type}}"

[destinations.kafka]
type = "kafka"
brokers = "{args.kafka_brokers}"
topic = "{topic}"
delivery_timeout = "5s"

[[routes]]
when = {{ aggregate_type = "invoice" }}
to = "rabbit"

[[routes]]
when = {{ aggregate_type = "shipment" }}
to = "kafka"

# The consumers' inbox. Here in the same database for brevity; usually the consumer's own
# (inbox.database_url).
[inbox]
schema = "{schema}"
table = "inbox"
""")
    outbox(args.outbox, "migrate", "--config", str(config))
    migrated = json.loads(outbox(args.outbox, "inbox", "migrate", "--config", str(config), "--json"))
    check(migrated["schema_version"] == 3,
          f"outbox inbox migrate: schema version {migrated['schema_version']} (3 expected); claim: {migrated['claim']}")
    claim = f'SELECT "{schema}"."inbox_claim"(%s, %s)'
    with psycopg.connect(args.dsn, autocommit=True) as db:
        db.execute(f'CREATE TABLE "{schema}".effects (event_id UUID NOT NULL, handler TEXT NOT NULL, '
                   "consumer TEXT NOT NULL, amount INT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        db.execute(f'CREATE TABLE "{schema}".seen (consumer TEXT NOT NULL, handler TEXT NOT NULL, '
                   "event_id UUID, outcome TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())")

    race(args.dsn, claim)

    # --- brokers -------------------------------------------------------------------------------
    amqp = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    channel = amqp.channel()
    channel.exchange_declare(exchange, exchange_type="topic", durable=False, auto_delete=False)
    channel.queue_declare(queue, durable=False)
    channel.queue_bind(queue, exchange, routing_key="#")
    admin = AdminClient({"bootstrap.servers": args.kafka_brokers})
    for f in admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)]).values():
        f.result(timeout=15)

    sup = Supervisor(workdir)
    try:
        sup.start("relay", [args.outbox, "relay", "--config", str(config)])
        python = sys.executable
        common = ["--dsn", args.dsn, "--schema", schema, "--inbox-schema", schema, "--inbox-table", "inbox"]
        broken = ["--break-claim"] if args.break_claim else []
        sup.start("py-billing", [python, str(HERE / "consumer.py"), "--broker", "rabbitmq", "--queue", queue,
                                 "--amqp-url", args.amqp_url, "--handler", "billing", "--name", "py",
                                 "--crash-every", "20", *common, *broken], restart_on_crash=True)
        sup.start("node-billing", [args.node, str(HERE / "consumer.js"), "--queue", queue, "--amqp-url", args.amqp_url,
                                   "--handler", "billing", "--name", "node", "--crash-every", "20", *common, *broken],
                  restart_on_crash=True)
        sup.start("py-shipping", [python, str(HERE / "consumer.py"), "--broker", "kafka", "--topic", topic,
                                  "--group", f"poly-{tag}", "--kafka-brokers", args.kafka_brokers,
                                  "--handler", "shipping", "--name", "py-kafka", "--crash-every", "30",
                                  *common, *broken], restart_on_crash=True)

        # --- events, written with plain SQL in the producer's transactions ------------------------
        n = args.events
        committed = {"invoice": set(), "shipment": set()}
        rolled_back = set()
        fail_once = set()
        insert = (f'INSERT INTO "{schema}".events (id, aggregate_type, aggregate_id, event_type, payload) '
                  "VALUES (%s, %s, %s, %s, %s)")
        with psycopg.connect(args.dsn) as db:
            for kind, event_type in (("invoice", "InvoiceIssued"), ("shipment", "ShipmentBooked")):
                for start in range(0, n, 10):
                    with db.transaction():
                        for i in range(start, min(start + 10, n)):
                            event_id = uuid.uuid4()
                            fails = i % 17 == 5
                            payload = json.dumps({"n": i, "amount": i + 1, "fail_once": fails})
                            db.execute(insert, (event_id, kind, f"{kind}-{i % 20}", event_type, payload))
                            committed[kind].add(event_id)
                            if fails:
                                fail_once.add(event_id)
                # A transaction that rolls back: its events must never have an effect.
                db.execute("BEGIN")
                for i in range(5):
                    event_id = uuid.uuid4()
                    db.execute(insert, (event_id, kind, f"{kind}-x", event_type, "{}"))
                    rolled_back.add(event_id)
                db.rollback()
        channel.basic_publish(exchange, "Poison", b"not an outbox message", pika.BasicProperties())
        amqp.close()
        say(f"enqueued {n} invoices (RabbitMQ) and {n} shipments (Kafka), {len(fail_once)} fail once")

        def effects(handler):
            with psycopg.connect(args.dsn) as db:
                return db.execute(f'SELECT count(DISTINCT event_id) FROM "{schema}".effects WHERE handler = %s',
                                  (handler,)).fetchone()[0]

        def handled():
            """Deliveries each handler finished (applied or skipped as a duplicate)."""
            with psycopg.connect(args.dsn) as db:
                return dict(db.execute(f'SELECT handler, count(*) FROM "{schema}".seen WHERE outcome IN '
                                       "('applied', 'duplicate') GROUP BY handler").fetchall())

        def undelivered():
            with psycopg.connect(args.dsn) as db:
                return db.execute(f'SELECT count(*) FROM "{schema}".events WHERE status <> %s',
                                  ("delivered",)).fetchone()[0]

        wait_for("every effect", 90, lambda: effects("billing") >= n and effects("shipping") >= n
                 and undelivered() == 0, sup)
        say(f"every event applied ({time.monotonic() - started:.1f} s); replaying all of them (outbox replay)")
        before = handled()
        replayed = outbox(args.outbox, "replay", "--config", str(config), "--from", "1h", "--json")
        say(f"outbox replay: {replayed.strip()}")
        wait_for("the replayed duplicates", 90, lambda: all(
            handled().get(h, 0) >= before.get(h, 0) + n for h in ("billing", "shipping")), sup)
        wait_for("the outbox drained again", 30, lambda: undelivered() == 0, sup)
        time.sleep(0.5)
        restarts = dict(sup.restarts)
    finally:
        sup.stop()

    # --- the checks ------------------------------------------------------------------------------
    with psycopg.connect(args.dsn) as db:
        for handler, kind in (("billing", "invoice"), ("shipping", "shipment")):
            counts = dict(db.execute(f'SELECT event_id, count(*) FROM "{schema}".effects WHERE handler = %s '
                                     "GROUP BY event_id", (handler,)).fetchall())
            twice = {e: c for e, c in counts.items() if c != 1}
            check(not twice, f"{handler}: every effect applied once ({len(twice)} applied more than once)")
            check(set(counts) == committed[kind],
                  f"{handler}: {len(counts)} of {len(committed[kind])} committed events applied, nothing else")
            check(not (set(counts) & rolled_back), f"{handler}: nothing from the rolled-back producer transaction")
            rolled = {r[0] for r in db.execute(f'SELECT event_id FROM "{schema}".seen WHERE handler = %s AND '
                                               "outcome = 'rolled_back'", (handler,)).fetchall()}
            mine = fail_once & committed[kind]
            check(mine and rolled == mine and all(counts.get(e) == 1 for e in mine),
                  f"{handler}: {len(mine)} effects rolled back once after their claim, then applied once")
            dups = db.execute(f'SELECT count(*) FROM "{schema}".seen WHERE handler = %s AND outcome = %s',
                              (handler, "duplicate")).fetchone()[0]
            check(dups >= len(committed[kind]), f"{handler}: {dups} duplicate deliveries skipped")
        by_consumer = dict(db.execute(f'SELECT consumer, count(*) FROM "{schema}".effects GROUP BY consumer').fetchall())
        check(by_consumer.get("py", 0) > 0 and by_consumer.get("node", 0) > 0,
              f"billing effects applied by both languages on one queue: {by_consumer}")
    check(all(restarts.get(c, 0) > 0 for c in ("py-billing", "node-billing", "py-shipping")),
          f"consumers killed between commit and ack and restarted: {restarts}")

    status = json.loads(outbox(args.outbox, "inbox", "status", "--config", str(config), "--json"))
    rows = {h["handler"]: h["rows"] for h in status["handlers"]}
    check(rows.get("billing") == n and rows.get("shipping") == n,
          f"outbox inbox status: one inbox row per effect {rows}, race rows aside")
    parked = json.loads(outbox(args.outbox, "inbox", "parked", "--config", str(config), "--json"))
    check(len(parked) == 1 and parked[0]["event_id"] is None and parked[0]["handler"] == "billing",
          f"outbox inbox parked: the message without an event id ({len(parked)} parked)")
    purged = json.loads(outbox(args.outbox, "inbox", "purge", "--config", str(config), "--older-than", "0s",
                               "--batch-size", "50", "--json"))
    check(purged["deleted"] == 2 * n + 2, f"outbox inbox purge --older-than 0s: {purged['deleted']} rows")

    orders_example(args, tag, workdir)

    elapsed = time.monotonic() - started
    if FAILURES:
        say(f"FAILED ({len(FAILURES)} check(s)) after {elapsed:.1f} s; schema {schema} and logs {workdir} kept")
        return 1
    if not args.keep:
        with psycopg.connect(args.dsn, autocommit=True) as db:
            db.execute(f'DROP SCHEMA "{schema}" CASCADE')
        amqp = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
        ch = amqp.channel()
        ch.queue_delete(queue)
        ch.exchange_delete(exchange)
        amqp.close()
        for f in admin.delete_topics([topic]).values():
            try:
                f.result(timeout=10)
            except Exception:
                pass
    say(f"PASS in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TimeoutError, RuntimeError) as error:
        say(f"FAILED: {error} (schemas outbox_t_poly*, queues, topics and logs of this run kept for a look; "
            "scripts/test.sh drops the schemas next time)")
        sys.exit(1)
