#!/usr/bin/env node
// A pacerd worker in Node.js (see README.md): consumes pacerd.ready.<DESTINATION>,
// calls the upstream with the job's idempotency key, and reports the outcome to
// pacerd.outcomes following pacerd/schemas/outcome.schema.json. The ready message
// is acknowledged only after the broker confirmed the outcome, so a crash at any
// point leaves the offer to be redelivered (or reclaimed by pacerd), never lost.
'use strict';

const amqp = require('amqplib');

const env = process.env;
const config = {
  amqpUrl: env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/',
  destination: env.DESTINATION,
  upstreamUrl: (env.UPSTREAM_URL || '').replace(/\/+$/, ''),
  queue: env.QUEUE || `pacerd.ready.${env.DESTINATION}`,
  prefetch: Number(env.PREFETCH || 16),
  graceMs: Number(env.SHUTDOWN_GRACE_SECONDS || 10) * 1000,
  upstreamTimeoutMs: Number(env.UPSTREAM_TIMEOUT_SECONDS || 30) * 1000,
};
const OUTCOMES_EXCHANGE = 'pacerd.outcomes';
const INVALID_QUEUE = 'pacerd.outcomes.invalid';
const DESTINATION_PATTERN = /^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$/;
const ELIGIBLE_AT_PATTERN = /^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$/;

function log(event, fields = {}) {
  process.stderr.write(`${JSON.stringify({ event, at: new Date().toISOString(), ...fields })}\n`);
}

const isAttempt = (v) => Number.isInteger(v) && v >= 1 && v <= 2147483647;
const isName = (v) => typeof v === 'string' && v.trim() !== '';

// The attempt a ready message's properties name (message_id = `<job_id>:<attempt>`,
// correlation_id = job_id), or {} when they do not name one consistently.
function attemptFromProperties(properties) {
  const messageId = properties && properties.messageId;
  if (typeof messageId !== 'string') return {};
  const colon = messageId.lastIndexOf(':');
  const jobId = messageId.slice(0, colon);
  const digits = messageId.slice(colon + 1);
  if (colon < 0 || !isName(jobId) || !/^[1-9][0-9]{0,9}$/.test(digits)) return {};
  const corr = properties.correlationId;
  if (corr !== undefined && corr !== null && corr !== jobId) return {};
  const attempt = Number(digits);
  return isAttempt(attempt) ? { jobId, attempt } : {};
}

// The ready message (ready.schema.json). Returns {job} or {error, jobId?, attempt?}:
// an invalid message that still names an attempt (in its body, or when the body
// cannot be decoded, in its properties) is reported as `fail`, any other is
// parked in pacerd.outcomes.invalid.
function decodeReady(content, properties = {}) {
  let doc;
  try {
    doc = JSON.parse(content.toString('utf8'));
  } catch (err) {
    return { error: `body is not JSON: ${err.message}`, ...attemptFromProperties(properties) };
  }
  if (doc === null || typeof doc !== 'object' || Array.isArray(doc)) {
    return { error: 'body must be a JSON object', ...attemptFromProperties(properties) };
  }
  const problems = [];
  if (!isName(doc.job_id)) problems.push('job_id must be a non-empty string');
  if (!isName(doc.kind)) problems.push('kind must be a non-empty string');
  if (typeof doc.destination !== 'string' || !DESTINATION_PATTERN.test(doc.destination)) {
    problems.push('destination must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,199}');
  }
  if (!isAttempt(doc.attempt)) problems.push('attempt must be an integer >= 1');
  if (!Number.isInteger(doc.revision) || doc.revision < 0) {
    problems.push('revision must be an integer >= 0');
  }
  for (const key of ['payload', 'cursor']) {
    if (!(key in doc)) problems.push(`${key} is required`);
  }
  if (typeof doc.eligible_at !== 'string' || !ELIGIBLE_AT_PATTERN.test(doc.eligible_at)) {
    problems.push('eligible_at must be an ISO-8601 date-time with an offset');
  }
  if (problems.length > 0) {
    return {
      error: `ready message does not follow ready.schema.json: ${problems.join('; ')}`,
      jobId: isName(doc.job_id) ? doc.job_id : undefined,
      attempt: isAttempt(doc.attempt) ? doc.attempt : undefined,
    };
  }
  return { job: doc };
}

// JSON with sorted keys and no spaces, non-ASCII escaped: the same text as
// Python's json.dumps(sort_keys=True, separators=(",", ":")).
function canonicalJson(value) {
  const sorted = (v) => {
    if (Array.isArray(v)) return v.map(sorted);
    if (v !== null && typeof v === 'object') {
      return Object.fromEntries(Object.keys(v).sort().map((k) => [k, sorted(v[k])]));
    }
    return v;
  };
  return JSON.stringify(sorted(value)).replace(
    /[\u0080-\uffff]/g,
    (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`,
  );
}

// Stable across redeliveries: the job id, plus the cursor for a chunk of a long job.
function idempotencyKey(job) {
  return job.cursor == null ? job.job_id : `${job.job_id}:${canonicalJson(job.cursor)}`;
}

function parseRetryAfter(value) {
  if (!value) return undefined;
  const seconds = /^\s*\d+(\.\d+)?\s*$/.test(value)
    ? Number(value)
    : (Date.parse(value) - Date.now()) / 1000;
  return Number.isFinite(seconds) ? Math.max(0, seconds) : undefined;
}

// The job's one side effect, and what its answer means for pacerd.
async function handle(job) {
  const base = { job_id: job.job_id, attempt: job.attempt };
  let response;
  try {
    response = await fetch(`${config.upstreamUrl}/v1/call`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'idempotency-key': idempotencyKey(job) },
      body: JSON.stringify(job.payload),
      signal: AbortSignal.timeout(config.upstreamTimeoutMs),
    });
  } catch (err) {
    return { ...base, outcome: 'retry', error: `upstream unreachable: ${err.message}` };
  }
  const text = await response.text().catch(() => '');
  if (response.status === 429) {
    const retryAfter = parseRetryAfter(response.headers.get('retry-after'));
    return { ...base, outcome: 'refused', ...(retryAfter === undefined ? {} : { retry_after_s: retryAfter }) };
  }
  if (response.status >= 500) {
    return { ...base, outcome: 'retry', error: `upstream answered HTTP ${response.status}` };
  }
  if (response.status >= 400) {
    return { ...base, outcome: 'fail', error: `upstream answered HTTP ${response.status}: ${text.slice(0, 200)}` };
  }
  let answer = {};
  try {
    answer = JSON.parse(text);
  } catch {
    // a 2xx without a JSON body is still done
  }
  return { ...base, outcome: 'ok', detail: { tokens: answer.tokens ?? null, duplicate: Boolean(answer.duplicate), worker: 'node' } };
}

let stopping = false;
let inFlight = 0;
let idle = null; // resolves when inFlight drops to 0 during shutdown
const returned = new Set(); // message ids the broker could not route (basic.return comes before the ack)

// Publishes with a publisher confirm; retried on nack or return until stopping.
async function publishConfirmed(channel, exchange, routingKey, body, options) {
  for (let delayMs = 200; ; delayMs = Math.min(delayMs * 2, 5000)) {
    try {
      await new Promise((resolve, reject) => {
        channel.publish(exchange, routingKey, body, { ...options, mandatory: true }, (err) => {
          if (err) reject(new Error('the broker nacked the message'));
          else if (returned.delete(options.messageId)) reject(new Error('no queue is bound'));
          else resolve();
        });
      });
      return;
    } catch (err) {
      log('outcome_publish_failed', { error: err.message, retry_in_ms: delayMs });
      if (stopping) throw err;
      await new Promise((r) => setTimeout(r, delayMs));
    }
  }
}

function publishOutcome(channel, outcome, headers) {
  const body = Buffer.from(JSON.stringify(outcome));
  return publishConfirmed(channel, OUTCOMES_EXCHANGE, '', body, {
    persistent: true,
    contentType: 'application/json',
    messageId: `${outcome.job_id}:${outcome.attempt}`,
    correlationId: outcome.job_id,
    // Continues the trace: an OpenTelemetry SDK would start a consumer span here.
    headers: headers.traceparent ? { traceparent: String(headers.traceparent) } : {},
  });
}

async function onMessage(consumer, publisher, msg) {
  inFlight += 1;
  const headers = msg.properties.headers || {};
  try {
    const decoded = decodeReady(msg.content, msg.properties);
    let outcome;
    if (decoded.job) {
      outcome = await handle(decoded.job);
    } else if (decoded.jobId !== undefined && decoded.attempt !== undefined) {
      outcome = { job_id: decoded.jobId, attempt: decoded.attempt, outcome: 'fail', error: decoded.error };
    } else {
      log('envelope_invalid', { reason: decoded.error, message_id: msg.properties.messageId });
      await publishConfirmed(publisher, '', INVALID_QUEUE, msg.content, {
        persistent: true,
        messageId: msg.properties.messageId || `invalid:${Date.now()}:${Math.random()}`,
        headers: { ...headers, 'x-pacerd-invalid-reason': decoded.error.slice(0, 1000), 'x-pacerd-source-queue': config.queue },
      });
      consumer.ack(msg);
      return;
    }
    await publishOutcome(publisher, outcome, headers);
    consumer.ack(msg); // only now: the outcome is confirmed
    log('outcome_reported', { job_id: outcome.job_id, attempt: outcome.attempt, outcome: outcome.outcome });
  } catch (err) {
    // Not acknowledged: the broker redelivers it when this connection closes.
    log('delivery_interrupted', { error: err.message, message_id: msg.properties.messageId });
  } finally {
    inFlight -= 1;
    if (inFlight === 0 && idle) idle();
  }
}

async function main() {
  if (!config.destination || !config.upstreamUrl) {
    log('usage', { error: 'set DESTINATION and UPSTREAM_URL (and AMQP_URL)' });
    process.exit(2);
  }
  const connection = await amqp.connect(config.amqpUrl);
  connection.on('error', (err) => log('connection_error', { error: err.message }));
  connection.on('close', () => {
    if (!stopping) {
      log('connection_lost');
      process.exit(1); // let the supervisor restart us; unacknowledged offers are redelivered
    }
  });
  const publisher = await connection.createConfirmChannel();
  publisher.on('return', (msg) => returned.add(msg.properties.messageId));
  const consumer = await connection.createChannel();
  await consumer.checkQueue(config.queue); // declared by pacerd
  await consumer.prefetch(config.prefetch);
  const { consumerTag } = await consumer.consume(config.queue, (msg) => {
    if (msg !== null) onMessage(consumer, publisher, msg);
  });
  log('worker_started', { queue: config.queue, prefetch: config.prefetch });

  const stop = async (signal) => {
    log('worker_signal', { signal });
    if (stopping) process.exit(1); // second signal: abandon in-flight work at once
    stopping = true;
    await consumer.cancel(consumerTag).catch(() => {});
    if (inFlight > 0) {
      await Promise.race([
        new Promise((resolve) => {
          idle = resolve;
        }),
        new Promise((resolve) => setTimeout(resolve, config.graceMs)),
      ]);
    }
    log('worker_stopped', { abandoned: inFlight });
    await connection.close().catch(() => {}); // unacknowledged offers return to the queue
    process.exit(0);
  };
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('SIGINT', () => stop('SIGINT'));
}

if (require.main === module) {
  main().catch((err) => {
    log('worker_failed', { error: err.message });
    process.exit(1);
  });
}

module.exports = { decodeReady, attemptFromProperties, idempotencyKey, canonicalJson, parseRetryAfter };
