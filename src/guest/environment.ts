/**
 * The sandbox-wide environment ({@link VmOptions.env}): variables every command of a Linux guest
 * gets, under its own `env`. The host keeps it and sends it with each request (the agent holds no
 * state for it), so it is bounded: it rides in every exec and spawn.
 * @module
 */
import { InvalidOptionError } from '../errors';

/** At most this many bytes of `NAME=value` (plus a NUL each) in a sandbox-wide environment. */
export const MAX_SANDBOX_ENV_BYTES = 64 * 1024;

/**
 * Checks `value` as environment variables and returns a frozen copy: an object of strings whose
 * names are non-empty, without `=` or NUL, and whose values have no NUL, `MAX_SANDBOX_ENV_BYTES`
 * in all; anything else is an {@link InvalidOptionError} naming `option`.
 */
export function parseEnvironment(option: string, value: unknown): Readonly<Record<string, string>> {
  if (value === undefined) return Object.freeze({});
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw new InvalidOptionError(option, 'expected an object of string variables, e.g. { LANG: "C.UTF-8" }');
  let bytes = 0;
  for (const [k, v] of Object.entries(value as Record<string, unknown>)) {
    if (!k || k.includes('=') || k.includes('\0')) throw new InvalidOptionError(option, `bad variable name ${JSON.stringify(k.slice(0, 80))}`);
    if (typeof v !== 'string') throw new InvalidOptionError(`${option}.${k}`, `a variable's value is a string, got ${v === null ? 'null' : typeof v}`);
    if (v.includes('\0')) throw new InvalidOptionError(`${option}.${k}`, 'must not contain NUL bytes');
    bytes += Buffer.byteLength(k) + Buffer.byteLength(v) + 2;
    if (bytes > MAX_SANDBOX_ENV_BYTES) throw new InvalidOptionError(option, `more than ${MAX_SANDBOX_ENV_BYTES} bytes of variables; it is sent with every command`);
  }
  return Object.freeze({ ...(value as Record<string, string>) });
}

/** A command's environment: the sandbox's, overridden by the command's own. */
export function mergeEnvironment(sandbox: Readonly<Record<string, string>>, own: Readonly<Record<string, string>> | undefined): Record<string, string> {
  return { ...sandbox, ...own };
}
