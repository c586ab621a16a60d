/**
 * Reading saved state back: the checks every state description (vCPU, VM, device) runs on a value
 * that came from a file, before any of it reaches KVM or a device. Each failure is a
 * {@link SnapshotError} that names the field by its path, e.g. `vcpus[1].regs`.
 *
 * Byte blobs travel as base64 strings: JSON has no bytes, and a number array would be four times
 * larger. 64-bit values travel as `0x`-prefixed hex strings, since a JSON number holds 53 bits.
 */
import { SnapshotError, SystemCallError } from '../errors';

/** `value` as a plain object, or a SnapshotError naming `path`. */
export function objectAt(value: unknown, path: string): Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw new SnapshotError(`${path}: expected an object, got ${describe(value)}`);
  return value as Record<string, unknown>;
}

/**
 * Checks `obj.version` against the one version this code reads. A newer version is refused, not
 * guessed at: its fields may mean something this code does not know.
 */
export function checkVersion(obj: Record<string, unknown>, path: string, version: number): void {
  const v = obj.version;
  if (v !== version) throw new SnapshotError(`${path}.version: this pvisor reads version ${version}, the state says ${describe(v)}`);
}

/** An integer field in [min, max]. */
export function integerAt(obj: Record<string, unknown>, key: string, path: string, min: number, max: number): number {
  const v = obj[key];
  if (typeof v !== 'number' || !Number.isInteger(v) || v < min || v > max) {
    throw new SnapshotError(`${path}.${key}: expected an integer in [${min}, ${max}], got ${describe(v)}`);
  }
  return v;
}

/** A boolean field. */
export function booleanAt(obj: Record<string, unknown>, key: string, path: string): boolean {
  const v = obj[key];
  if (typeof v !== 'boolean') throw new SnapshotError(`${path}.${key}: expected true or false, got ${describe(v)}`);
  return v;
}

/** A string field that is one of `allowed`. */
export function choiceAt<T extends string>(obj: Record<string, unknown>, key: string, path: string, allowed: readonly T[]): T {
  const v = obj[key];
  if (typeof v !== 'string' || !(allowed as readonly string[]).includes(v)) {
    throw new SnapshotError(`${path}.${key}: expected one of ${allowed.join(', ')}, got ${describe(v)}`);
  }
  return v as T;
}

const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/**
 * A base64 field decoded, of exactly `sizeBytes` bytes (or, given a range, between its ends).
 * Strict: Node's decoder skips characters it does not know, which would hide a damaged blob.
 */
export function bytesAt(obj: Record<string, unknown>, key: string, path: string, sizeBytes: number | { min: number; max: number }): Buffer {
  const v = obj[key];
  if (typeof v !== 'string' || !BASE64.test(v)) throw new SnapshotError(`${path}.${key}: expected base64 bytes, got ${describe(v)}`);
  const bytes = Buffer.from(v, 'base64');
  const [min, max] = typeof sizeBytes === 'number' ? [sizeBytes, sizeBytes] : [sizeBytes.min, sizeBytes.max];
  if (bytes.length < min || bytes.length > max) {
    throw new SnapshotError(`${path}.${key}: expected ${min === max ? min : `${min} to ${max}`} bytes, got ${bytes.length}`);
  }
  return bytes;
}

/** A 64-bit value written by {@link hexU64}. */
export function u64At(obj: Record<string, unknown>, key: string, path: string): bigint {
  const v = obj[key];
  if (typeof v !== 'string' || !/^0x[0-9a-f]{1,16}$/.test(v)) throw new SnapshotError(`${path}.${key}: expected a 64-bit value as 0x-prefixed hex, got ${describe(v)}`);
  return BigInt(v);
}

/**
 * A string field of 1 to `maxLength` characters; with `pattern`, one it matches whole. A path,
 * for instance, or a digest in hex.
 */
export function stringAt(obj: Record<string, unknown>, key: string, path: string, maxLength: number, pattern?: RegExp): string {
  const v = obj[key];
  if (typeof v !== 'string' || v.length === 0 || v.length > maxLength || (pattern && !pattern.test(v))) {
    throw new SnapshotError(`${path}.${key}: expected ${pattern ? `a string matching ${pattern}` : `a string of 1 to ${maxLength} characters`}, got ${describe(v)}`);
  }
  return v;
}

/** An array field. */
export function arrayAt(obj: Record<string, unknown>, key: string, path: string, maxLength: number): unknown[] {
  const v = obj[key];
  if (!Array.isArray(v)) throw new SnapshotError(`${path}.${key}: expected an array, got ${describe(v)}`);
  if (v.length > maxLength) throw new SnapshotError(`${path}.${key}: at most ${maxLength} entries, got ${v.length}`);
  return v;
}

/**
 * Runs `apply`, a call that hands KVM the saved field at `path`. The checks above take only a
 * field's shape; KVM judges its value, and its refusal (a {@link SystemCallError}, EINVAL for a
 * value it does not take) becomes a {@link SnapshotError} naming the field, with KVM's as cause.
 */
export function kvmTakes<T>(path: string, apply: () => T): T {
  try {
    return apply();
  } catch (e) {
    if (!(e instanceof SystemCallError)) throw e;
    throw new SnapshotError(`${path}: KVM refused the saved value (${e.message})`, { cause: e });
  }
}

/** How a 64-bit value is written into a description. */
export function hexU64(value: bigint): string {
  return `0x${value.toString(16)}`;
}

/** How a byte blob is written into a description. */
export function base64Of(bytes: Buffer): string {
  return bytes.toString('base64');
}

function describe(v: unknown): string {
  if (v === undefined) return 'nothing (missing)';
  if (v === null) return 'null';
  if (typeof v === 'string') return v.length > 40 ? `a string of ${v.length} characters` : JSON.stringify(v);
  if (Array.isArray(v)) return `an array of ${v.length}`;
  if (typeof v === 'object') return 'an object';
  return `${typeof v} ${String(v)}`;
}
