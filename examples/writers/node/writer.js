#!/usr/bin/env node
// An order service in Node that writes events to the outbox: the business row and the event
// in one transaction, so both commit or neither does.
//
// Two ways, both in the table contract (docs/table-contract.md):
// - the enqueue function the migrations install (checks the event, makes a time-ordered id,
//   handles idempotency keys and the partitioned layout);
// - a plain INSERT of the required columns.
//
// Usage: node writer.js DATABASE_URL SCHEMA
// Writes three orders each way, committing every one and rolling back a second attempt in
// between, and prints {"committed": [...], "rolled_back": [...]}: event ids in commit order.

const { Client } = require('pg');
const { randomUUID } = require('crypto');

async function main() {
  const [url, schema] = process.argv.slice(2);
  const events = `"${schema}".events`;
  const enqueue = `"${schema}".events_enqueue`;
  const committed = [];
  const rolledBack = [];
  const client = new Client({ connectionString: url });
  await client.connect();
  try {
    for (let n = 0; n < 3; n++) {
      for (const commit of [true, false]) {
        await client.query('BEGIN');
        await client.query(`INSERT INTO "${schema}".orders (id, lang, n) VALUES ($1, $2, $3)`, [randomUUID(), 'node', n]);
        const { rows } = await client.query(
          `SELECT ${enqueue}($1, $2, $3, $4::json, headers => $5::jsonb) AS id`,
          ['order', 'js-fn', 'OrderPlaced', JSON.stringify({ n, lang: 'node' }), JSON.stringify({ writer: 'node' })],
        );
        await client.query(commit ? 'COMMIT' : 'ROLLBACK');
        (commit ? committed : rolledBack).push(rows[0].id);

        await client.query('BEGIN');
        await client.query(`INSERT INTO "${schema}".orders (id, lang, n) VALUES ($1, $2, $3)`, [randomUUID(), 'node', n]);
        const id = randomUUID();
        await client.query(
          `INSERT INTO ${events} (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4, $5::json)`,
          [id, 'order', 'js-insert', 'OrderPlaced', JSON.stringify({ n })],
        );
        await client.query(commit ? 'COMMIT' : 'ROLLBACK');
        (commit ? committed : rolledBack).push(id);
      }
    }
  } finally {
    await client.end();
  }
  console.log(JSON.stringify({ committed, rolled_back: rolledBack }));
}

main().catch((e) => { console.error(e.message); process.exit(1); });
