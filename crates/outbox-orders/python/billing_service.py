"""billing-service, written in Python: the Order system's billing consumer (the same effects as
the Rust `billing-service`, see outbox_orders::consumers) reading NATS JetStream with nats-py
and writing PostgreSQL with psycopg — no Rust, only the outbox inbox's claim function
(docs/inbox.md).

It charges every order once (OrderCreated) and refunds it once (OrderCancelled), in table
`billing_ledger` of its own database. Per message:

    BEGIN
    SELECT "<schema>"."inbox_claim"(event_id, 'billing')
      false -> ROLLBACK, ack                       (a duplicate: already charged/refunded)
      true  -> INSERT INTO billing_ledger …; COMMIT; ack
    error -> ROLLBACK, nak (redelivered later); after --max-attempts: park, ack

The inbox is created beforehand with `outbox inbox migrate --database-url … --table inbox`
(scripts/orders.sh does). `--crash-every N` exits between a commit and its ack, for tests.
"""

import argparse
import asyncio
import json
import os
import signal
import sys

import nats
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

HANDLER = "billing"


class CreationNotSeenYet(Exception):
    """A cancellation arrived before its order's charge was applied: try again later."""


LEDGER = """
CREATE TABLE IF NOT EXISTS billing_ledger (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    TEXT NOT NULL,
    action      TEXT NOT NULL CHECK (action IN ('charge', 'refund')),
    value       BIGINT NOT NULL,
    event_id    TEXT NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS billing_ledger_order ON billing_ledger (order_id, action);
"""


async def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--schema", default="public", help="schema of billing_ledger and the inbox")
    p.add_argument("--inbox-table", default="inbox")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--stream", default="ORDERS")
    p.add_argument("--subjects", default="orders.>")
    p.add_argument("--durable", default="billing-py")
    p.add_argument("--max-attempts", type=int, default=10)
    p.add_argument("--ack-wait", type=float, default=30.0,
                   help="seconds before JetStream redelivers a message that was not acked (a crash)")
    p.add_argument("--crash-every", type=int, default=0)
    args = p.parse_args()

    db = await psycopg.AsyncConnection.connect(args.database_url, options=f"-csearch_path={args.schema}")
    await db.execute(LEDGER)
    await db.commit()
    claim_sql = f'SELECT "{args.schema}"."{args.inbox_table}_claim"(%s, %s)'
    parked_table = f'"{args.schema}"."{args.inbox_table}_parked"'
    try:
        await db.execute(claim_sql, ("00000000-0000-0000-0000-000000000000", HANDLER))
    except psycopg.errors.UndefinedFunction:
        sys.exit(f"billing-service.py: no inbox in schema {args.schema}: run "
                 f"`outbox inbox migrate --database-url … --schema {args.schema} --table {args.inbox_table}` first")
    finally:
        await db.rollback()

    nc = await nats.connect(args.nats_url)
    js = nc.jetstream()
    try:
        await js.stream_info(args.stream)
    except nats.js.errors.NotFoundError:
        await js.add_stream(name=args.stream, subjects=[args.subjects])
    sub = await js.pull_subscribe(
        args.subjects, durable=args.durable, stream=args.stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=args.ack_wait),
    )
    print(f"billing-service.py: Consuming from NATS JetStream stream {args.stream} as {args.durable}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    applied = 0

    async def apply(event_id, event_type, body):
        """Claim and apply in one transaction: True if applied, False for a duplicate."""
        async with db.transaction():
            (fresh,) = await (await db.execute(claim_sql, (event_id, HANDLER))).fetchone()
            if not fresh:
                return False
            if event_type == "OrderCreated":
                action = "charge"
            elif event_type == "OrderCancelled":
                cur = await db.execute("SELECT count(*) FROM billing_ledger WHERE order_id = %s AND action = 'charge'",
                                       (body["order_id"],))
                if (await cur.fetchone())[0] == 0:
                    raise CreationNotSeenYet(body["order_id"])  # rolls back the claim too
                action = "refund"
            else:
                return True  # recorded in the inbox, no effect
            await db.execute(
                "INSERT INTO billing_ledger (order_id, action, value, event_id) VALUES (%s, %s, %s, %s)",
                (body["order_id"], action, body["amount_cents"], event_id),
            )
        return True

    async def park(msg, event_id, error):
        async with db.transaction():
            await db.execute(
                f"INSERT INTO {parked_table} (event_id, handler, source, attempts, error, payload, headers) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (event_id, HANDLER, msg.subject, msg.metadata.num_delivered, error, msg.data,
                 json.dumps(dict(msg.headers or {}))),
            )
        await msg.ack()

    while not stop.is_set():
        try:
            msgs = await sub.fetch(50, timeout=1)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            continue
        for msg in msgs:
            headers = msg.headers or {}
            event_id = headers.get("outbox-event-id")
            if not event_id:
                await park(msg, None, "no outbox-event-id header: cannot be deduplicated")
                continue
            try:
                body = json.loads(msg.data)
                fresh = await apply(event_id, headers.get("outbox-event-type"), body)
            except (ValueError, KeyError) as error:
                await park(msg, event_id, f"malformed payload: {error}")
                continue
            except Exception as error:
                if msg.metadata.num_delivered >= args.max_attempts:
                    await park(msg, event_id, f"{type(error).__name__}: {error}")
                else:
                    await msg.nak(delay=0.5)
                continue
            if fresh:
                applied += 1
                if args.crash_every and applied % args.crash_every == 0:
                    print("billing-service.py: crashing after commit, before ack", flush=True)
                    os._exit(3)
            await msg.ack()  # only after the commit
    await nc.close()
    await db.close()


if __name__ == "__main__":
    asyncio.run(main())
