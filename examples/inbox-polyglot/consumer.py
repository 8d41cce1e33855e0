"""A consumer of the outbox relay's output written in Python: RabbitMQ (pika) or Kafka
(confluent-kafka), with its effects in PostgreSQL (psycopg) deduplicated by the outbox inbox.

What every message goes through (docs/inbox.md, "the consumer loop"):

    BEGIN
    SELECT "<schema>"."<table>_claim"(event_id, handler)   -- first statement of the transaction
      true  -> apply the effect in this transaction, COMMIT, then ack
      false -> already processed: ROLLBACK (nothing was written), then ack
    any error -> ROLLBACK (the claim goes with it), then nack / retry: a redelivery claims again

The effect here is one row in `<schema>.effects` (deliberately without a unique key, so a
second application would show as a second row). Test hooks, off unless asked for:
`--crash-every N` exits the process right after the Nth commit, before the ack (the broker
redelivers); events whose payload says `"fail_once": true` fail after the effect was written,
once (the rollback must undo the claim too); `--break-claim` ignores the claim's answer, to show
that the proof catches a double effect.
"""

import argparse
import json
import os
import sys
import time

import psycopg

EVENT_ID = "outbox-event-id"


class Consumer:
    def __init__(self, args):
        self.args = args
        self.schema = args.schema
        self.db = psycopg.connect(args.dsn)
        # Outcome log: outside the effect's transaction, for the proof's checks only.
        self.log = psycopg.connect(args.dsn, autocommit=True)
        self.claim_sql = f'SELECT "{args.inbox_schema}"."{args.inbox_table}_claim"(%s, %s)'
        self.applied = 0

    def record(self, event_id, outcome):
        self.log.execute(
            f'INSERT INTO "{self.schema}".seen (consumer, handler, event_id, outcome) VALUES (%s, %s, %s, %s)',
            (self.args.name, self.args.handler, event_id, outcome),
        )

    def handle(self, event_id, payload):
        """Claim and apply in one transaction. Returns "applied" or "duplicate"; raises on failure
        (after rolling back)."""
        body = json.loads(payload)
        try:
            with self.db.transaction():
                fresh = self.db.execute(self.claim_sql, (event_id, self.args.handler)).fetchone()[0]
                if not fresh and not self.args.break_claim:
                    return "duplicate"
                self.db.execute(
                    f'INSERT INTO "{self.schema}".effects (event_id, handler, consumer, amount) VALUES (%s, %s, %s, %s)',
                    (event_id, self.args.handler, self.args.name, body.get("amount", 0)),
                )
                if body.get("fail_once") and not self.failed_before(event_id):
                    self.record(event_id, "rolled_back")
                    raise RuntimeError("injected failure after the effect was written")
        except RuntimeError:
            raise
        self.applied += 1
        return "applied"

    def failed_before(self, event_id):
        row = self.log.execute(
            f'SELECT 1 FROM "{self.schema}".seen WHERE event_id = %s AND handler = %s AND outcome = %s',
            (event_id, self.args.handler, "rolled_back"),
        ).fetchone()
        return row is not None

    def park(self, event_id, source, payload, headers, error):
        """A message that can never be processed (here: no outbox-event-id) goes to the parked
        table, then is acked."""
        with self.db.transaction():
            self.db.execute(
                f'INSERT INTO "{self.args.inbox_schema}"."{self.args.inbox_table}_parked" '
                "(event_id, handler, source, attempts, error, payload, headers) VALUES (%s, %s, %s, 1, %s, %s, %s)",
                (event_id, self.args.handler, source, error, payload, json.dumps(headers)),
            )
        self.record(event_id, "parked")

    def after_commit(self, outcome):
        """The crash hook: between the commit and the ack."""
        if outcome == "applied" and self.args.crash_every and self.applied % self.args.crash_every == 0:
            print(f"{self.args.name}: crashing after commit, before ack", flush=True)
            os._exit(3)


def text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def run_rabbitmq(consumer, args):
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=args.prefetch)

    def on_message(ch, method, properties, body):
        headers = {k: text(v) for k, v in (properties.headers or {}).items()}
        event_id = headers.get(EVENT_ID) or properties.message_id
        if not event_id:
            consumer.park(None, args.queue, body, headers, "no outbox-event-id header: cannot be deduplicated")
            ch.basic_ack(method.delivery_tag)
            return
        try:
            outcome = consumer.handle(event_id, body)
        except Exception as error:  # rolled back: let the broker deliver it again
            print(f"{args.name}: {event_id}: {error}; nack", flush=True)
            ch.basic_nack(method.delivery_tag, requeue=True)
            return
        consumer.record(event_id, outcome)
        consumer.after_commit(outcome)
        ch.basic_ack(method.delivery_tag)  # only after the commit

    channel.basic_consume(queue=args.queue, on_message_callback=on_message)
    print(f"{args.name}: consuming {args.queue}", flush=True)
    channel.start_consuming()


def run_kafka(consumer, args):
    from confluent_kafka import Consumer as KafkaConsumer, TopicPartition

    kafka = KafkaConsumer({
        "bootstrap.servers": args.kafka_brokers,
        "group.id": args.group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    })
    # Direct assignment, starting at the group's committed offsets: no rebalance wait.
    metadata = kafka.list_topics(args.topic, timeout=10)
    partitions = sorted(metadata.topics[args.topic].partitions)
    kafka.assign([TopicPartition(args.topic, p) for p in partitions])
    print(f"{args.name}: consuming {args.topic} partitions {partitions}", flush=True)
    while True:
        msg = kafka.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            print(f"{args.name}: kafka error {msg.error()}", flush=True)
            continue
        headers = {k: text(v) for k, v in (msg.headers() or [])}
        event_id = headers.get(EVENT_ID)
        if not event_id:
            consumer.park(None, args.topic, msg.value(), headers, "no outbox-event-id header: cannot be deduplicated")
            kafka.commit(message=msg, asynchronous=False)
            continue
        # Kafka does not redeliver one message: retry it in place until it succeeds.
        while True:
            try:
                outcome = consumer.handle(event_id, msg.value())
                break
            except Exception as error:
                print(f"{args.name}: {event_id}: {error}; retrying", flush=True)
                time.sleep(0.2)
        consumer.record(event_id, outcome)
        consumer.after_commit(outcome)
        kafka.commit(message=msg, asynchronous=False)  # the offset only after the commit


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--broker", choices=["rabbitmq", "kafka"], required=True)
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", required=True, help="schema of the effects and seen tables")
    p.add_argument("--inbox-schema", default="public")
    p.add_argument("--inbox-table", default="outbox_inbox")
    p.add_argument("--handler", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/%2f")
    p.add_argument("--queue")
    p.add_argument("--prefetch", type=int, default=10)
    p.add_argument("--kafka-brokers", default="127.0.0.1:19092")
    p.add_argument("--topic")
    p.add_argument("--group")
    p.add_argument("--crash-every", type=int, default=0)
    p.add_argument("--break-claim", action="store_true")
    args = p.parse_args()
    consumer = Consumer(args)
    if args.broker == "rabbitmq":
        run_rabbitmq(consumer, args)
    else:
        run_kafka(consumer, args)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(0)
