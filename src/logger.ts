/**
 * The `logger` option of `Vm.start` and `Vm.restore`: where a VM's trace goes (agent requests,
 * strategy operations, state changes, exits of note, warnings). Silent without one.
 *
 * A logger is the user's code running inside pvisor's receive paths: one that throws must not
 * break a request or a suspend, so each call is guarded, and the trace carries only what the
 * host decided (op names, durations, states), never guest output.
 */
import { InvalidOptionError } from './errors';
import type { EventEmitter } from 'eventemitter3';

/**
 * Structured fields of one log line; `vm` is always the VM's name.
 * @category VM
 */
export type LogFields = Readonly<Record<string, string | number | boolean | null>>;

/**
 * Where a VM's trace goes. `console` is one; a pino or winston logger fits through a one-line
 * adapter (their argument order differs). Levels: `debug` for each agent request and strategy
 * operation, `info` for state changes and lifetimes, `warn` for warnings, `error` for crashes.
 * @category VM
 */
export interface Logger {
  debug(message: string, fields: LogFields): void;
  info(message: string, fields: LogFields): void;
  warn(message: string, fields: LogFields): void;
  error(message: string, fields: LogFields): void;
}

const LEVELS = ['debug', 'info', 'warn', 'error'] as const;
type Level = (typeof LEVELS)[number];

/** `undefined`, or a logger with all four methods; anything else is an {@link InvalidOptionError}. */
export function parseLogger(value: unknown): Logger | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'object' || value === null) throw new InvalidOptionError('logger', `expected an object with debug, info, warn and error methods, got ${value === null ? 'null' : typeof value}`);
  const missing = LEVELS.filter((l) => typeof (value as Record<string, unknown>)[l] !== 'function');
  if (missing.length) throw new InvalidOptionError('logger', `has no ${missing.join(', ')} method${missing.length > 1 ? 's' : ''}`);
  return value as Logger;
}

/** One VM's trace: each line carries the VM's name; a logger that throws is ignored. */
export class VmLog {
  constructor(
    private readonly logger: Logger | undefined,
    private readonly vm: string,
  ) {}

  /** Whether anything is traced (callers skip building fields when not). */
  get enabled(): boolean {
    return this.logger !== undefined;
  }

  write(level: Level, message: string, fields: Record<string, string | number | boolean | null> = {}): void {
    if (!this.logger) return;
    try {
      this.logger[level](message, { vm: this.vm, ...fields });
    } catch {
      // The user's logger failed: the VM goes on without that line.
    }
  }

  /** Traces the VM's own events: states and exits at info, warnings at warn, crashes at error. */
  followEvents(vm: EventEmitter): void {
    if (!this.logger) return;
    vm.on('state', (state: string) => this.write('info', `state ${state}`, { state }));
    vm.on('warning', (message: string) => this.write('warn', message));
    vm.on('crash', (error: Error) => this.write('error', `crashed: ${error.message}`, { error: error.name }));
    vm.on('exit', (info: { state: string; hibernatedTo?: string }) => this.write('info', `exited (${info.state})`, { state: info.state, hibernatedTo: info.hibernatedTo ?? null }));
    vm.on('released', (info: { ms: number; error?: Error }) => this.write(info.error ? 'warn' : 'debug', info.error ? `memory not all released: ${info.error.message}` : 'memory released', { ms: info.ms }));
    vm.on('timeout-warning', (info: { remainingMs: number; onTimeout: string }) => this.write('info', `lifetime ends in ${info.remainingMs} ms`, { remainingMs: info.remainingMs, onTimeout: info.onTimeout }));
    vm.on('timeout', (info: { onTimeout: string; error?: Error }) => this.write(info.error ? 'warn' : 'info', info.error ? `lifetime ended; ${info.onTimeout} failed: ${info.error.message}` : `lifetime ended: ${info.onTimeout}`, { onTimeout: info.onTimeout }));
  }
}
