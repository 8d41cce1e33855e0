// A consumer of the outbox relay's output written for Node: RabbitMQ (amqplib), effects in
// PostgreSQL (pg), deduplicated by the outbox inbox. The same loop as consumer.py
// (docs/inbox.md, "the consumer loop"):
//
//   BEGIN
//   SELECT "<schema>"."<table>_claim"($1, $2)   -- first statement of the transaction
//     true  -> apply the effect in this transaction, COMMIT, then ack
//     false -> already processed: ROLLBACK (nothing was written), then ack
//   any error -> ROLLBACK (the claim goes with it), then nack: a redelivery claims again
//
// Test hooks as in consumer.py: --crash-every N (exit after the Nth commit, before the ack),
// payloads with "fail_once": true (fail once after the effect was written), --break-claim.
'use strict';

const amqp = require('amqplib');
const { Client } = require('pg');

function parseArgs(argv) {
  const args = {
    inboxSchema: 'public',
    inboxTable: 'outbox_inbox',
    amqpUrl: 'amqp://guest:guest@127.0.0.1:5672/%2f',
    prefetch: 10,
    crashEvery: 0,
    breakClaim: false,
  };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    if (key === 'breakClaim') {
      args.breakClaim = true;
    } else {
      args[key] = argv[++i];
    }
  }
  args.prefetch = Number(args.prefetch);
  args.crashEvery = Number(args.crashEvery);
  for (const required of ['dsn', 'schema', 'handler', 'name', 'queue']) {
    if (!args[required]) throw new Error(`--${required} is required`);
  }
  return args;
}

function text(value) {
  if (value === undefined || value === null) return null;
  return Buffer.isBuffer(value) ? value.toString('utf8') : String(value);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const db = new Client({ connectionString: args.dsn });
  const log = new Client({ connectionString: args.dsn }); // outcome log, outside the effect's transaction
  await db.connect();
  await log.connect();
  const claimSql = `SELECT "${args.inboxSchema}"."${args.inboxTable}_claim"($1, $2) AS fresh`;
  const effects = `"${args.schema}".effects`;
  const seen = `"${args.schema}".seen`;
  let applied = 0;

  const record = (eventId, outcome) =>
    log.query(`INSERT INTO ${seen} (consumer, handler, event_id, outcome) VALUES ($1, $2, $3, $4)`,
      [args.name, args.handler, eventId, outcome]);

  async function failedBefore(eventId) {
    const r = await log.query(
      `SELECT 1 FROM ${seen} WHERE event_id = $1 AND handler = $2 AND outcome = 'rolled_back'`,
      [eventId, args.handler]);
    return r.rowCount > 0;
  }

  // Claim and apply in one transaction: "applied" or "duplicate"; throws after rolling back.
  async function handle(eventId, body) {
    await db.query('BEGIN');
    try {
      const { rows } = await db.query(claimSql, [eventId, args.handler]);
      if (!rows[0].fresh && !args.breakClaim) {
        await db.query('ROLLBACK');
        return 'duplicate';
      }
      await db.query(`INSERT INTO ${effects} (event_id, handler, consumer, amount) VALUES ($1, $2, $3, $4)`,
        [eventId, args.handler, args.name, body.amount || 0]);
      if (body.fail_once && !(await failedBefore(eventId))) {
        await record(eventId, 'rolled_back');
        throw new Error('injected failure after the effect was written');
      }
      await db.query('COMMIT');
      applied += 1;
      return 'applied';
    } catch (error) {
      await db.query('ROLLBACK');
      throw error;
    }
  }

  const connection = await amqp.connect(args.amqpUrl);
  const channel = await connection.createChannel();
  await channel.prefetch(args.prefetch);
  // One message at a time, in order: the pg client runs one transaction at a time.
  let chain = Promise.resolve();
  await channel.consume(args.queue, (msg) => {
    chain = chain.then(async () => {
      const headers = msg.properties.headers || {};
      const eventId = text(headers['outbox-event-id']) || msg.properties.messageId;
      if (!eventId) {
        await db.query(
          `INSERT INTO "${args.inboxSchema}"."${args.inboxTable}_parked" (event_id, handler, source, attempts, error, payload, headers)
           VALUES (NULL, $1, $2, 1, $3, $4, $5)`,
          [args.handler, args.queue, 'no outbox-event-id header: cannot be deduplicated', msg.content,
            JSON.stringify(Object.fromEntries(Object.entries(headers).map(([k, v]) => [k, text(v)])))]);
        await record(null, 'parked');
        channel.ack(msg);
        return;
      }
      let outcome;
      try {
        outcome = await handle(eventId, JSON.parse(msg.content.toString('utf8')));
      } catch (error) {
        console.log(`${args.name}: ${eventId}: ${error.message}; nack`);
        channel.nack(msg, false, true);
        return;
      }
      await record(eventId, outcome);
      if (outcome === 'applied' && args.crashEvery && applied % args.crashEvery === 0) {
        console.log(`${args.name}: crashing after commit, before ack`);
        process.exit(3);
      }
      channel.ack(msg); // only after the commit
    }).catch((error) => {
      console.error(`${args.name}: ${error.stack || error}`);
      process.exit(1);
    });
  });
  console.log(`${args.name}: consuming ${args.queue}`);
  const stop = () => process.exit(0);
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((error) => {
  console.error(error.stack || error);
  process.exit(1);
});
