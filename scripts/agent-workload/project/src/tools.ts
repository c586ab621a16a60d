// The tools an agent offers the model, each with a typed description of its input.

export type ParamType = 'string' | 'number' | 'boolean' | 'string[]';

type TypeOf<T extends ParamType> = T extends 'string'
  ? string
  : T extends 'number'
    ? number
    : T extends 'boolean'
      ? boolean
      : string[];

export type Params = Record<string, { type: ParamType; required?: boolean; description: string }>;

export type InputOf<P extends Params> = {
  [K in keyof P as P[K]['required'] extends true ? K : never]: TypeOf<P[K]['type']>;
} & {
  [K in keyof P as P[K]['required'] extends true ? never : K]?: TypeOf<P[K]['type']>;
};

export interface Tool<P extends Params = Params> {
  name: string;
  description: string;
  params: P;
  run(input: InputOf<P>): Promise<string>;
}

export class ToolError extends Error {
  constructor(
    readonly tool: string,
    message: string,
  ) {
    super(`${tool}: ${message}`);
  }
}

function matches(type: ParamType, value: unknown): boolean {
  if (type === 'string[]') return Array.isArray(value) && value.every((v) => typeof v === 'string');
  return typeof value === type;
}

/** Checks what the model sent against the tool's parameters; throws a ToolError naming the first fault. */
export function checkInput<P extends Params>(tool: Tool<P>, input: Record<string, unknown>): InputOf<P> {
  for (const [name, spec] of Object.entries(tool.params)) {
    const value = input[name];
    if (value === undefined) {
      if (spec.required) throw new ToolError(tool.name, `missing ${name}`);
      continue;
    }
    if (!matches(spec.type, value)) throw new ToolError(tool.name, `${name} must be ${spec.type}`);
  }
  for (const name of Object.keys(input)) {
    if (!(name in tool.params)) throw new ToolError(tool.name, `unknown parameter ${name}`);
  }
  return input as InputOf<P>;
}

export class ToolBox {
  private readonly tools = new Map<string, Tool>();

  add<P extends Params>(tool: Tool<P>): this {
    if (this.tools.has(tool.name)) throw new ToolError(tool.name, 'defined twice');
    this.tools.set(tool.name, tool as unknown as Tool);
    return this;
  }

  describe(): { name: string; description: string; params: string[] }[] {
    return [...this.tools.values()].map((t) => ({
      name: t.name,
      description: t.description,
      params: Object.entries(t.params).map(([k, v]) => `${k}: ${v.type}${v.required ? '' : '?'}`),
    }));
  }

  async call(name: string, input: Record<string, unknown>): Promise<{ output: string; isError: boolean }> {
    const tool = this.tools.get(name);
    if (!tool) return { output: `no tool named ${name}`, isError: true };
    try {
      return { output: await tool.run(checkInput(tool, input)), isError: false };
    } catch (e) {
      return { output: e instanceof Error ? e.message : String(e), isError: true };
    }
  }
}

export const echoTool: Tool<{ words: { type: 'string[]'; required: true; description: string }; upper: { type: 'boolean'; description: string } }> = {
  name: 'echo',
  description: 'Says the words back',
  params: {
    words: { type: 'string[]', required: true, description: 'what to say' },
    upper: { type: 'boolean', description: 'in capitals' },
  },
  async run(input) {
    const said = input.words.join(' ');
    return input.upper ? said.toUpperCase() : said;
  },
};
