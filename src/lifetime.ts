/**
 * A VM's lifetime ({@link VmOptions.timeoutMs}): one timer that says, some time before the
 * deadline, that it is near (so the caller can extend it), and then that it has come. It knows
 * nothing of VMs: {@link Vm} decides what expiry does (suspend, hibernate, stop).
 *
 * The timer is unref'd: a lifetime must not keep the Node process alive by itself (a script that
 * is done may end; its VMs end with it).
 * @module
 */
import { resolve } from 'node:path';
import { InvalidOptionError } from './errors';
import { parseTimeoutMs } from './units';

/**
 * What a VM does when its lifetime expires: see {@link VmOptions.onTimeout}.
 * @category VM
 */
export type TimeoutAction = 'suspend' | 'hibernate' | 'stop';

/** The warning comes this long before the deadline, at most... */
export const MAX_TIMEOUT_WARNING_LEAD_MS = 10_000;

/** ...and at most half the lifetime before it, so that a short lifetime is not warned at once. */
export function timeoutWarningLeadMs(lifetimeMs: number): number {
  return Math.min(MAX_TIMEOUT_WARNING_LEAD_MS, Math.floor(lifetimeMs / 2));
}

/** What the timer calls. Either may set or clear the lifetime again. */
export interface LifetimeHooks {
  /** The deadline is `remainingMs` away (called once per deadline, before `expire`). */
  warn(remainingMs: number): void;
  /** The deadline has come; the lifetime is now unset. */
  expire(): void;
}

/** One deadline, its warning and its expiry. */
export class Lifetime {
  private timer: NodeJS.Timeout | undefined;
  private deadlineMs: number | undefined;
  private leadMs = 0;
  private warned = false;
  /** Changes with every set and clear: a hook that set the lifetime again is not overridden. */
  private generation = 0;
  private lastMs: number | undefined;

  constructor(
    private readonly hooks: LifetimeHooks,
    private readonly now: () => number = () => Date.now(),
  ) {}

  /** Sets the deadline `ms` from now (a whole number, 1 ms to about 24.8 days), replacing any other. */
  set(ms: number): void {
    const checked = parseTimeoutMs('timeoutMs', ms);
    this.clear();
    this.lastMs = checked;
    this.deadlineMs = this.now() + checked;
    this.leadMs = timeoutWarningLeadMs(checked);
    this.arm();
  }

  /** Unsets the deadline: nothing will fire. */
  clear(): void {
    this.generation++;
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    this.deadlineMs = undefined;
    this.warned = false;
  }

  /** The deadline (ms since the epoch, as `Date.now()`), if one is set. */
  get expiresAtMs(): number | undefined {
    return this.deadlineMs;
  }

  /** The length of the lifetime last set, even once it has expired or was cleared. */
  get lastLifetimeMs(): number | undefined {
    return this.lastMs;
  }

  private arm(): void {
    const remaining = this.deadlineMs! - this.now();
    const next = this.warned ? remaining : remaining - this.leadMs;
    this.timer = setTimeout(() => this.fire(), Math.max(0, next));
    this.timer.unref();
  }

  private fire(): void {
    this.timer = undefined;
    if (this.deadlineMs === undefined) return;
    const generation = this.generation;
    const remaining = this.deadlineMs - this.now();
    if (!this.warned && remaining - this.leadMs <= 0) {
      this.warned = true;
      this.hooks.warn(Math.max(0, remaining));
      // The hook set or cleared the lifetime: that is the lifetime now.
      if (generation !== this.generation) return;
    }
    if (this.deadlineMs - this.now() <= 0) {
      this.clear();
      this.hooks.expire();
      return;
    }
    this.arm();
  }
}

/** The lifetime options of {@link Vm.start} and {@link Vm.restore}, checked. */
export interface LifetimeOptions {
  timeoutMs?: number;
  onTimeout: TimeoutAction;
  /** Absolute; given exactly when `onTimeout` is `hibernate`. */
  hibernateDir?: string;
}

/**
 * Checks `timeoutMs`, `onTimeout` (default `stop`) and `hibernateDir` (needed by, and only by,
 * `onTimeout: 'hibernate'`; made absolute against `cwd`, since the expiry may come after the
 * process has changed its working directory).
 */
export function parseLifetimeOptions(options: { timeoutMs?: unknown; onTimeout?: unknown; hibernateDir?: unknown }, cwd: string = process.cwd()): LifetimeOptions {
  const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
  const onTimeout = options.onTimeout ?? 'stop';
  if (onTimeout !== 'suspend' && onTimeout !== 'hibernate' && onTimeout !== 'stop') {
    throw new InvalidOptionError('onTimeout', `expected "suspend", "hibernate" or "stop", got ${typeof onTimeout === 'string' ? JSON.stringify(onTimeout) : String(onTimeout)}`);
  }
  const dir = options.hibernateDir;
  if (onTimeout === 'hibernate') {
    if (typeof dir !== 'string' || !dir || dir.includes('\0')) throw new InvalidOptionError('hibernateDir', "onTimeout: 'hibernate' needs hibernateDir, the directory the VM goes to (new, or empty)");
    return { timeoutMs, onTimeout, hibernateDir: resolve(cwd, dir) };
  }
  if (dir !== undefined) throw new InvalidOptionError('hibernateDir', `only goes with onTimeout: 'hibernate' (onTimeout is ${JSON.stringify(onTimeout)})`);
  return { timeoutMs, onTimeout };
}
