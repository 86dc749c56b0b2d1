// Drives the server with the official `openai` npm client: completions and chat, streaming and not, usage.
// Usage: node openai_client.mjs <port> <model> [http|https] (https: NODE_EXTRA_CA_CERTS names the server's CA).
// Exits non-zero (with the reason) on the first failed check.
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '..', 'npm', 'package.json'));
const OpenAI = require('openai');

const [port, model, scheme = 'http'] = process.argv.slice(2);
const client = new OpenAI({
  baseURL: `${scheme}://127.0.0.1:${port}/v1`, apiKey: 'unused', timeout: 60000, maxRetries: 0,
});

function check(cond, what, detail) {
  if (!cond) {
    console.error(`FAILED: ${what}`, detail === undefined ? '' : JSON.stringify(detail));
    process.exit(1);
  }
}

// Completions, non-streaming.
const c = await client.completions.create({ model, prompt: 'The capital of France is', max_tokens: 8, temperature: 0, ignore_eos: true });
check(c.object === 'text_completion', 'completion object', c);
check(c.choices.length === 1 && typeof c.choices[0].text === 'string', 'completion choice', c);
check(c.choices[0].finish_reason === 'length', 'completion finish_reason', c);
check(c.usage.completion_tokens === 8 && c.usage.prompt_tokens > 1, 'completion usage', c.usage);
check(c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens, 'completion total_tokens', c.usage);

// Completions, streaming, usage at the end; the streamed text equals the non-streamed one (greedy).
let text = '';
let usage = null;
let finish = null;
const cs = await client.completions.create({ model, prompt: 'The capital of France is', max_tokens: 8, temperature: 0,
  ignore_eos: true, stream: true, stream_options: { include_usage: true } });
for await (const chunk of cs) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    text += ch.text;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(text === c.choices[0].text, 'streamed completion text equals non-streamed', { text, expected: c.choices[0].text });
check(finish === 'length', 'streamed completion finish', finish);
check(usage && usage.completion_tokens === 8, 'streamed completion usage', usage);

// Completions with n = 2 and logprobs.
const cn = await client.completions.create({ model, prompt: 'Hello', max_tokens: 3, n: 2, logprobs: 2, temperature: 0, ignore_eos: true });
check(cn.choices.length === 2 && cn.choices[1].index === 1, 'n = 2', cn);
check(cn.choices[0].logprobs.tokens.length === 3 && cn.choices[0].logprobs.token_logprobs.every(x => x <= 0), 'completion logprobs', cn.choices[0].logprobs);

// Chat, non-streaming.
const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hi.' }];
const r = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0 });
check(r.object === 'chat.completion', 'chat object', r);
check(r.choices[0].message.role === 'assistant' && typeof r.choices[0].message.content === 'string', 'chat message', r);
check(['length', 'stop'].includes(r.choices[0].finish_reason), 'chat finish_reason', r);
check(r.usage.prompt_tokens > 5 && r.usage.completion_tokens >= 1, 'chat usage', r.usage);

// Chat, streaming with usage: role first, then content deltas, then finish, then usage.
let content = '';
let sawRole = false;
usage = null;
finish = null;
const rs = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0, stream: true,
  stream_options: { include_usage: true } });
for await (const chunk of rs) {
  check(chunk.object === 'chat.completion.chunk', 'chat chunk object', chunk);
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    if (ch.delta.role) sawRole = true;
    if (ch.delta.content) content += ch.delta.content;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(sawRole, 'chat stream starts with the assistant role');
check(content === r.choices[0].message.content, 'streamed chat content equals non-streamed', { content, expected: r.choices[0].message.content });
check(finish === r.choices[0].finish_reason, 'streamed chat finish', finish);
check(usage && usage.completion_tokens === r.usage.completion_tokens && usage.prompt_tokens === r.usage.prompt_tokens, 'streamed chat usage', usage);

// lm-eval-harness's loglikelihood request: token ids, echo, logprobs 1, one new token; the prompt's tokens lead the
// lists (the first one's logprob and alternatives null), and a token that is the most likely one has exactly the
// best alternative's logprob (lm-eval's greedy test).
const prompt = [1000, 2000, 3000, 4000, 5000];
const ll = await client.completions.create({ model, prompt, max_tokens: 1, echo: true, logprobs: 1, temperature: 0 });
const lp = ll.choices[0].logprobs;
check(lp.tokens.length === prompt.length + 1 && lp.token_logprobs.length === prompt.length + 1,
  'echo logprobs length', lp);
check(lp.token_logprobs[0] === null && lp.top_logprobs[0] === null, 'echo: the first token has no logprob', lp);
check(lp.token_logprobs.slice(1).every(x => x <= 0), 'echo logprobs are logprobs', lp.token_logprobs);
for (let i = 1; i <= prompt.length; ++i) {
  const best = Math.max(...Object.values(lp.top_logprobs[i]));
  check(lp.token_logprobs[i] <= best + 1e-6, 'no token beats the best alternative', { i, lp });
}
const last = lp.token_logprobs[prompt.length];
check(last === Math.max(...Object.values(lp.top_logprobs[prompt.length])), 'the greedy new token is the best', lp);
// vLLM's prompt_logprobs (an extra body field for the client).
const pl = await client.completions.create({ model, prompt, max_tokens: 1, prompt_logprobs: 2 });
const plp = pl.choices[0].prompt_logprobs;
check(Array.isArray(plp) && plp.length === prompt.length && plp[0] === null, 'prompt_logprobs list', plp);
check(Math.abs(plp[1][String(prompt[1])].logprob - lp.token_logprobs[1]) < 1e-3, 'prompt_logprobs = echo logprobs',
  plp[1]);

// Errors surface as the client's typed errors with the server's status.
try {
  await client.chat.completions.create({ model: 'no-such-model', messages, max_tokens: 2 });
  check(false, 'unknown model must fail');
} catch (e) {
  check(e.status === 404, 'unknown model -> 404', { status: e.status, message: e.message });
}
try {
  await client.completions.create({ model, prompt: 'x', max_tokens: 2, temperature: -1 });
  check(false, 'negative temperature must fail');
} catch (e) {
  check(e.status === 400, 'negative temperature -> 400', { status: e.status, message: e.message });
}
try {  // this server has no --tool-call-parser
  await client.chat.completions.create({ model, messages, max_tokens: 2,
    tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }] });
  check(false, 'tools without a parser must fail');
} catch (e) {
  check(e.status === 400 && e.message.includes('--tool-call-parser'), 'tools without a parser -> 400',
    { status: e.status, message: e.message });
}

// The Responses API: the same greedy text as chat, streamed as typed events, and through the SDK's stream helper
// (which checks the events' order and the items' identities).
const rq = { model, input: 'The capital of France is', max_output_tokens: 6, temperature: 0 };
const resp = await client.responses.create(rq);
check(resp.object === 'response' && resp.status === 'incomplete' &&
  resp.incomplete_details?.reason === 'max_output_tokens', 'responses create', resp);
check(resp.usage.output_tokens === 6 && resp.usage.total_tokens === resp.usage.input_tokens + 6, 'responses usage',
  resp.usage);
const sameChat = await client.chat.completions.create({ model, messages: [{ role: 'user', content: rq.input }],
  max_tokens: 6, temperature: 0 });
check(resp.output_text === sameChat.choices[0].message.content, 'responses text = chat text',
  { responses: resp.output_text, chat: sameChat.choices[0].message.content });
let streamedText = '';
let lastEvent = null;
for await (const ev of await client.responses.create({ ...rq, stream: true })) {
  if (ev.type === 'response.output_text.delta') streamedText += ev.delta;
  lastEvent = ev;
}
check(streamedText === resp.output_text && lastEvent.type === 'response.incomplete' &&
  lastEvent.response.usage.output_tokens === 6, 'responses stream', { streamedText, lastEvent });
const yesNo = await client.responses.stream({ model, input: 'Yes or no?', temperature: 0, max_output_tokens: 20,
  text: { format: { type: 'json_schema', name: 'yn', schema: { type: 'string', enum: ['yes', 'no'] } } } })
  .finalResponse();
check(yesNo.status === 'completed' && ['"yes"', '"no"'].includes(yesNo.output_text.trim()), 'responses stream helper',
  yesNo);

// Stored responses: retrieve, a continuation through previous_response_id (greedy: the same text as chat given the
// whole conversation), its input items, delete; a background response polled to its end, and one cancelled.
const counted = await client.responses.inputTokens.count({ model, input: rq.input });
check(counted.object === 'response.input_tokens' && counted.input_tokens === resp.usage.input_tokens,
  'responses input token count = the response\'s input tokens', { counted, usage: resp.usage });
const stored = await client.responses.retrieve(resp.id);
check(stored.id === resp.id && stored.status === resp.status && stored.output_text === resp.output_text,
  'responses retrieve', stored);
const followUp = 'And of Italy?';
const next = await client.responses.create({ model, input: followUp, previous_response_id: resp.id,
  max_output_tokens: 6, temperature: 0 });
const nextChat = await client.chat.completions.create({ model, max_tokens: 6, temperature: 0, messages: [
  { role: 'user', content: rq.input }, { role: 'assistant', content: resp.output_text },
  { role: 'user', content: followUp }] });
check(next.previous_response_id === resp.id && next.output_text === nextChat.choices[0].message.content &&
  next.usage.input_tokens === nextChat.usage.prompt_tokens, 'previous_response_id continues the conversation',
  { next, chat: nextChat });
const inputItems = [];
for await (const item of client.responses.inputItems.list(next.id, { limit: 1 })) inputItems.push(item);
check(inputItems.length === 1 && inputItems[0].type === 'message' && inputItems[0].content[0].text === followUp,
  'responses input items', inputItems);
await client.responses.delete(next.id);
try {
  await client.responses.retrieve(next.id);
  check(false, 'a deleted response must be gone');
} catch (e) {
  check(e.status === 404, 'deleted response -> 404', { status: e.status, message: e.message });
}
let bg = await client.responses.create({ ...rq, background: true });
check(bg.background === true && ['queued', 'in_progress', 'incomplete'].includes(bg.status), 'background create', bg);
for (let i = 0; i < 3000 && (bg.status === 'queued' || bg.status === 'in_progress'); ++i) {
  await new Promise(r => setTimeout(r, 10));
  bg = await client.responses.retrieve(bg.id);
}
check(bg.status === 'incomplete' && bg.output_text === resp.output_text, 'background response polled', bg);
const longBg = await client.responses.create({ model, input: 'Count', max_output_tokens: 1000, ignore_eos: true,
  background: true });
const cancelled = await client.responses.cancel(longBg.id);
check(cancelled.id === longBg.id && cancelled.status === 'cancelled', 'background response cancelled', cancelled);
// A background response streamed: its creator leaves after a few events, then resumes from its cursor with
// retrieve(id, { stream: true, starting_after }) to the end; the text is the foreground response's.
const bgStream = await client.responses.create({ ...rq, background: true, stream: true });
let cursor = -1, bgId = null, bgText = '';
for await (const ev of bgStream) {
  bgId = bgId ?? ev.response?.id;
  cursor = ev.sequence_number;
  if (ev.type === 'response.output_text.delta') bgText += ev.delta;
  if (cursor >= 2) break;  // leaves the stream (the generation goes on)
}
const resumed = [];
for await (const ev of await client.responses.retrieve(bgId, { stream: true, starting_after: cursor })) {
  resumed.push(ev);
  if (ev.type === 'response.output_text.delta') bgText += ev.delta;
}
const lastEv = resumed[resumed.length - 1];
check(cursor === 2 && resumed.length > 0 && resumed[0].sequence_number === 3 &&
  resumed.every((e, i) => e.sequence_number === 3 + i) && lastEv?.type === 'response.incomplete' &&
  lastEv.response.id === bgId && lastEv.response.background === true && bgText === resp.output_text,
  'background stream resumed from its cursor', { cursor, bgText, resumed });

// Models list.
const models = await client.models.list();
check(models.data.some(m => m.id === model), 'models list', models.data);
const card = await client.models.retrieve(model);
check(card.id === model && card.object === 'model', 'models retrieve', card);
try {
  await client.models.retrieve('org/no-such-model');
  check(false, 'retrieving an unknown model must fail');
} catch (e) {
  check(e.status === 404, 'unknown model retrieve -> 404', { status: e.status, message: e.message });
}
// Files and batches: a JSONL of chat requests (one invalid) uploaded, run as a batch, its output and error files
// read back; each answer equals the same request sent directly (greedy).
const { toFile } = require('openai');
const lines = [
  { custom_id: 'a', method: 'POST', url: '/v1/chat/completions',
    body: { model, messages: [{ role: 'user', content: 'Say hi.' }], max_tokens: 5, temperature: 0 } },
  { custom_id: 'bad', method: 'POST', url: '/v1/chat/completions',
    body: { model, messages: [{ role: 'user', content: 'x' }], max_tokens: -1 } },
  { custom_id: 'b', method: 'POST', url: '/v1/chat/completions',
    body: { model, messages: [{ role: 'user', content: 'Count to three.' }], max_tokens: 7, temperature: 0 } },
];
const upload = await client.files.create({
  file: await toFile(Buffer.from(lines.map(l => JSON.stringify(l)).join('\n') + '\n'), 'requests.jsonl'),
  purpose: 'batch' });
check(upload.object === 'file' && upload.purpose === 'batch' && upload.filename === 'requests.jsonl', 'file upload',
  upload);
let batch = await client.batches.create({ input_file_id: upload.id, endpoint: '/v1/chat/completions',
  completion_window: '24h', metadata: { job: 'npm' } });
check(batch.object === 'batch' && batch.request_counts.total === 3 && batch.metadata.job === 'npm', 'batch create',
  batch);
for (let i = 0; i < 600 && !['completed', 'failed', 'cancelled'].includes(batch.status); ++i) {
  await new Promise(res => setTimeout(res, 100));
  batch = await client.batches.retrieve(batch.id);
}
check(batch.status === 'completed' && batch.request_counts.completed === 2 && batch.request_counts.failed === 1,
  'batch completed', batch);
const outText = await (await client.files.content(batch.output_file_id)).text();
const outs = outText.trim().split('\n').map(l => JSON.parse(l));
check(outs.map(o => o.custom_id).join(',') === 'a,b' && outs.every(o => o.response.status_code === 200),
  'batch output lines', outs);
for (const o of outs) {
  const direct = await client.chat.completions.create(lines.find(l => l.custom_id === o.custom_id).body);
  check(o.response.body.choices[0].message.content === direct.choices[0].message.content, 'batch answer = direct',
    { batch: o.response.body, direct });
}
const errText = await (await client.files.content(batch.error_file_id)).text();
const errs = errText.trim().split('\n').map(l => JSON.parse(l));
check(errs.length === 1 && errs[0].custom_id === 'bad' && errs[0].response.status_code === 400 &&
  errs[0].response.body.error.param === 'max_tokens', 'batch error file', errs);
const listed = await client.batches.list();
check(listed.data.some(b => b.id === batch.id), 'batch list', listed.data);
const deleted = await client.files.del ? await client.files.del(upload.id) : await client.files.delete(upload.id);
check(deleted.deleted === true, 'file delete', deleted);

console.log('openai client: all checks passed');
