#!/usr/bin/env python3
"""An order service in Python that writes events to the outbox: the business row and the event
in one transaction, so both commit or neither does.

Two ways, both in the table contract (docs/table-contract.md):
- the enqueue function the migrations install (checks the event, makes a time-ordered id,
  handles idempotency keys and the partitioned layout);
- a plain INSERT of the required columns.

Usage: writer.py DATABASE_URL SCHEMA
Writes three orders each way, committing every one and rolling back a second attempt in
between, and prints {"committed": [...], "rolled_back": [...]}: event ids in commit order.
"""

import json
import sys
import uuid

import psycopg

url, schema = sys.argv[1], sys.argv[2]
events = f'"{schema}".events'
enqueue = f'"{schema}".events_enqueue'
committed, rolled_back = [], []

with psycopg.connect(url) as conn:
    for n in range(3):
        for commit in (True, False):
            conn.execute(
                f'INSERT INTO "{schema}".orders (id, lang, n) VALUES (%s, %s, %s)',
                (str(uuid.uuid4()), "python", n),
            )
            event_id = conn.execute(
                f"SELECT {enqueue}(%s, %s, %s, %s::json, headers => %s::jsonb)",
                (
                    "order",
                    "py-fn",
                    "OrderPlaced",
                    json.dumps({"n": n, "lang": "python"}),
                    json.dumps({"writer": "python"}),
                ),
            ).fetchone()[0]
            (conn.commit if commit else conn.rollback)()
            (committed if commit else rolled_back).append(str(event_id))

            conn.execute(
                f'INSERT INTO "{schema}".orders (id, lang, n) VALUES (%s, %s, %s)',
                (str(uuid.uuid4()), "python", n),
            )
            event_id = str(uuid.uuid4())
            conn.execute(
                f"INSERT INTO {events} (id, aggregate_type, aggregate_id, event_type, payload)"
                " VALUES (%s, %s, %s, %s, %s::json)",
                (event_id, "order", "py-insert", "OrderPlaced", json.dumps({"n": n})),
            )
            (conn.commit if commit else conn.rollback)()
            (committed if commit else rolled_back).append(event_id)

print(json.dumps({"committed": committed, "rolled_back": rolled_back}))
