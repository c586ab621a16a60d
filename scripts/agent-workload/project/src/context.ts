// The context window: the history is trimmed to a token budget before each request to the model,
// oldest turns first, never the system prompt and never half of a tool call.

import { Message, plainText } from './messages';
import { TokenCache } from './tokens';

export interface Budget {
  maxTokens: number;
  /** Tokens kept free for the model's answer. */
  reserveTokens: number;
}

export interface Window {
  messages: Message[];
  tokens: number;
  dropped: number;
}

/** Turns: a user message and everything up to the next one, kept or dropped together. */
function turns(history: readonly Message[]): Message[][] {
  const out: Message[][] = [];
  for (const m of history) {
    if (m.role === 'user' || out.length === 0) out.push([m]);
    else out[out.length - 1].push(m);
  }
  return out;
}

export function fitWindow(history: readonly Message[], budget: Budget, cache = new TokenCache()): Window {
  const limit = budget.maxTokens - budget.reserveTokens;
  if (limit <= 0) throw new RangeError(`a budget of ${budget.maxTokens} with ${budget.reserveTokens} reserved leaves nothing`);
  const system = history.filter((m) => m.role === 'system');
  const rest = turns(history.filter((m) => m.role !== 'system'));
  const cost = (ms: readonly Message[]) => ms.reduce((n, m) => n + cache.count(plainText(m)), 0);
  let tokens = cost(system);
  const kept: Message[][] = [];
  let dropped = 0;
  for (let i = rest.length - 1; i >= 0; i--) {
    const c = cost(rest[i]);
    if (tokens + c > limit) {
      dropped += rest.slice(0, i + 1).reduce((n, t) => n + t.length, 0);
      break;
    }
    tokens += c;
    kept.unshift(rest[i]);
  }
  return { messages: [...system, ...kept.flat()], tokens, dropped };
}
