// One agent session: the loop of asking the model, running the tools it calls, and asking again.

import { Budget, fitWindow, Window } from './context';
import { callsOf, Message, text, unansweredCalls } from './messages';
import { ToolBox } from './tools';

export interface Model {
  reply(window: Window): Promise<Message>;
}

export type SessionEvent =
  | { type: 'asked'; tokens: number; dropped: number }
  | { type: 'answered'; calls: number }
  | { type: 'tool'; name: string; isError: boolean }
  | { type: 'done'; turns: number };

export class Session {
  readonly history: Message[] = [];
  private readonly listeners: ((e: SessionEvent) => void)[] = [];

  constructor(
    private readonly model: Model,
    private readonly tools: ToolBox,
    private readonly budget: Budget,
    systemPrompt: string,
  ) {
    this.history.push(text('system', systemPrompt));
  }

  on(listener: (e: SessionEvent) => void): void {
    this.listeners.push(listener);
  }

  private emit(e: SessionEvent): void {
    for (const l of this.listeners) l(e);
  }

  /** Runs until the model answers without calling a tool, or maxTurns model replies. */
  async ask(question: string, maxTurns = 8): Promise<Message> {
    this.history.push(text('user', question, Date.now()));
    for (let turn = 1; turn <= maxTurns; turn++) {
      const window = fitWindow(this.history, this.budget);
      this.emit({ type: 'asked', tokens: window.tokens, dropped: window.dropped });
      const reply = await this.model.reply(window);
      this.history.push(reply);
      const calls = callsOf(reply);
      this.emit({ type: 'answered', calls: calls.length });
      if (calls.length === 0) {
        this.emit({ type: 'done', turns: turn });
        return reply;
      }
      const results = await Promise.all(calls.map(async (c) => ({ call: c, result: await this.tools.call(c.tool, c.input) })));
      this.history.push({
        role: 'tool',
        at: Date.now(),
        parts: results.map(({ call, result }) => {
          this.emit({ type: 'tool', name: call.tool, isError: result.isError });
          return { kind: 'tool-result' as const, callId: call.callId, output: result.output, isError: result.isError };
        }),
      });
    }
    const open = unansweredCalls(this.history);
    throw new Error(`no answer after ${maxTurns} turns${open.length ? `, calls open: ${open.join(', ')}` : ''}`);
  }
}
