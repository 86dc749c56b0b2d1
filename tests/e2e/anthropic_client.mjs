// Drives the server's Messages API with the official `@anthropic-ai/sdk` npm client: a message, the same streamed,
// token counting, a forced tool call and its result sent back, an error. The server runs with --tool-call-parser
// deepseekv3 and --api-key (the client sends it as x-api-key).
// Usage: node anthropic_client.mjs <port> <model> <api key>. Exits non-zero (with the reason) on the first failed
// check.
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '..', 'npm', 'package.json'));
const AnthropicModule = require('@anthropic-ai/sdk');
const Anthropic = AnthropicModule.default ?? AnthropicModule.Anthropic ?? AnthropicModule;

const [port, model, apiKey] = process.argv.slice(2);
const client = new Anthropic({ baseURL: `http://127.0.0.1:${port}`, apiKey, timeout: 60000, maxRetries: 0 });

function check(cond, what, detail) {
  if (!cond) {
    console.error(`FAILED: ${what}`, detail === undefined ? '' : JSON.stringify(detail));
    process.exit(1);
  }
}

const messages = [{ role: 'user', content: 'Name a city in France.' }];
const m = await client.messages.create({ model, max_tokens: 8, temperature: 0, system: 'Be brief.', messages });
check(m.type === 'message' && m.role === 'assistant', 'message object', m);
check(m.id.startsWith('msg_') && m.model === model, 'message id and model', m);
check(m.content.length >= 1 && m.content.at(-1).type === 'text', 'a text block', m.content);
check(['max_tokens', 'end_turn'].includes(m.stop_reason), 'stop_reason', m);
check(m.usage.input_tokens > 1 && m.usage.output_tokens >= 1 && m.usage.output_tokens <= 8, 'usage', m.usage);

// The same streamed: the SDK assembles the events into the same message (greedy).
const stream = client.messages.stream({ model, max_tokens: 8, temperature: 0, system: 'Be brief.', messages });
let streamed = '';
stream.on('text', (t) => { streamed += t; });
const fm = await stream.finalMessage();
const text = (msg) => msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
check(streamed === text(m) && text(fm) === text(m), 'streamed text equals the message', { streamed, m: text(m) });
check(fm.stop_reason === m.stop_reason, 'streamed stop_reason', fm);
check(fm.usage.output_tokens === m.usage.output_tokens, 'streamed output tokens', fm.usage);

// Token counting agrees with the message's input tokens.
const count = await client.messages.countTokens({ model, system: 'Be brief.', messages });
check(count.input_tokens === m.usage.input_tokens + (m.usage.cache_read_input_tokens ?? 0), 'count_tokens',
  { count, usage: m.usage });

// A forced tool call: a tool_use block whose input follows the schema; its result goes back as a tool_result.
const tools = [{
  name: 'get_weather', description: 'The weather in a city',
  input_schema: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'] },
}];
const t = await client.messages.create({
  model, max_tokens: 64, temperature: 0, tools, tool_choice: { type: 'tool', name: 'get_weather' },
  messages: [{ role: 'user', content: 'Weather in Paris?' }],
});
const use = t.content.find((b) => b.type === 'tool_use');
check(use && use.name === 'get_weather' && typeof use.input.city === 'string', 'tool_use block', t.content);
check(t.stop_reason === 'tool_use', 'tool_use stop_reason', t);
const back = await client.messages.create({
  model, max_tokens: 4, temperature: 0, tools,
  messages: [{ role: 'user', content: 'Weather in Paris?' }, { role: 'assistant', content: t.content },
    { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: 'sunny' }] }],
});
const input = (u) => u.input_tokens + (u.cache_read_input_tokens ?? 0);  // (cache reads counted apart)
check(back.type === 'message' && input(back.usage) > input(t.usage), 'the tool result sent back', back);

// A bad request: the SDK's BadRequestError with Anthropic's error body.
let failed = null;
try {
  await client.messages.create({ model, max_tokens: 4, messages: [{ role: 'user', content: [{ type: 'image',
    source: { type: 'base64', media_type: 'image/png', data: 'AAAA' } }] }] });
} catch (e) {
  failed = e;
}
check(failed && failed.status === 400 && failed.error?.type === 'error' &&
      failed.error?.error?.type === 'invalid_request_error', 'a 400 in Anthropic form', failed?.error);

console.log('all checks passed');
