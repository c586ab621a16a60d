// The conversation an agent keeps: what each party said, and the tool calls in between.

export type Role = 'system' | 'user' | 'assistant' | 'tool';

export interface TextPart {
  kind: 'text';
  text: string;
}

export interface ToolCallPart {
  kind: 'tool-call';
  callId: string;
  tool: string;
  input: Record<string, unknown>;
}

export interface ToolResultPart {
  kind: 'tool-result';
  callId: string;
  output: string;
  isError: boolean;
}

export type Part = TextPart | ToolCallPart | ToolResultPart;

export interface Message {
  role: Role;
  parts: Part[];
  /** Milliseconds since the epoch. */
  at: number;
}

export function text(role: Role, body: string, at = 0): Message {
  return { role, parts: [{ kind: 'text', text: body }], at };
}

export function plainText(message: Message): string {
  return message.parts
    .map((p) => {
      switch (p.kind) {
        case 'text':
          return p.text;
        case 'tool-call':
          return `[call ${p.tool} ${JSON.stringify(p.input)}]`;
        case 'tool-result':
          return `[${p.isError ? 'error' : 'result'} ${p.output}]`;
      }
    })
    .join('\n');
}

export function callsOf(message: Message): ToolCallPart[] {
  return message.parts.filter((p): p is ToolCallPart => p.kind === 'tool-call');
}

/** Every call is answered by exactly one result, after it. */
export function unansweredCalls(history: readonly Message[]): string[] {
  const open = new Map<string, number>();
  history.forEach((m, i) => {
    for (const p of m.parts) {
      if (p.kind === 'tool-call') open.set(p.callId, i);
      else if (p.kind === 'tool-result') open.delete(p.callId);
    }
  });
  return [...open.keys()];
}
