// The pieces of a small agent, put together with a model that answers from a script.

import { Window } from './context';
import { Message, plainText, text } from './messages';
import { Model, Session, SessionEvent } from './session';
import { countTokens } from './tokens';
import { echoTool, ToolBox } from './tools';

export class ScriptedModel implements Model {
  private step = 0;

  constructor(private readonly script: readonly Message[]) {}

  async reply(window: Window): Promise<Message> {
    const next = this.script[this.step++];
    if (!next) return text('assistant', `out of script after ${window.messages.length} messages`);
    return next;
  }
}

export async function demo(): Promise<{ answer: string; events: SessionEvent[]; tokens: number }> {
  const model = new ScriptedModel([
    { role: 'assistant', at: 0, parts: [{ kind: 'tool-call', callId: 'c1', tool: 'echo', input: { words: ['hello', 'guest'], upper: true } }] },
    text('assistant', 'The tool said HELLO GUEST.'),
  ]);
  const session = new Session(model, new ToolBox().add(echoTool), { maxTokens: 4096, reserveTokens: 1024 }, 'You are a test agent.');
  const events: SessionEvent[] = [];
  session.on((e) => events.push(e));
  const reply = await session.ask('Say hello to the guest.');
  const answer = plainText(reply);
  return { answer, events, tokens: countTokens(session.history.map(plainText).join('\n')).tokens };
}

export { fitWindow } from './context';
export { Session } from './session';
export { ToolBox } from './tools';
