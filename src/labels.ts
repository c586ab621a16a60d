/**
 * Labels: the caller's own string-to-string tags on a VM ({@link VmOptions.labels}), shown by
 * {@link Vm.list}, the control socket's status and `pvisor ps`. They travel to other processes
 * (the control socket, a hibernation), so they are checked and bounded where they are given and
 * again where they are read back: a key is 1-63 letters, digits, `.`, `_`, `-` or `/`, beginning
 * with a letter or digit (it is printed as `key=value`, and cannot be `__proto__`); a value is a
 * string of at most 256 characters with no control character (the `pvisor ps` table prints it);
 * at most 64 labels.
 * @module
 */
import { InvalidOptionError } from './errors';

/**
 * Labels of a VM: see {@link VmOptions.labels}.
 * @category VM
 */
export type Labels = Readonly<Record<string, string>>;

/** At most this many labels on one VM. */
export const MAX_LABELS = 64;
/** At most this many characters in a label's value. */
export const MAX_LABEL_VALUE_CHARS = 256;
const KEY = /^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$/;
// eslint-disable-next-line no-control-regex
const CONTROL_CHAR = /[\u0000-\u001f\u007f-\u009f]/;

/**
 * Checks `value` as labels and returns a frozen copy; anything else is an
 * {@link InvalidOptionError} naming `option` (and the label).
 */
export function parseLabels(option: string, value: unknown): Labels {
  if (value === undefined) return Object.freeze({});
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw new InvalidOptionError(option, 'expected an object of string labels, e.g. { team: "search" }');
  const entries = Object.entries(value as Record<string, unknown>);
  if (entries.length > MAX_LABELS) throw new InvalidOptionError(option, `${entries.length} labels; at most ${MAX_LABELS}`);
  for (const [k, v] of entries) checkLabel(option, k, v);
  return Object.freeze(Object.fromEntries(entries) as Record<string, string>);
}

function checkLabel(option: string, key: string, value: unknown): void {
  if (!KEY.test(key)) throw new InvalidOptionError(`${option}.${key.slice(0, 64)}`, 'a label key is 1-63 letters, digits, ".", "_", "-" or "/", beginning with a letter or digit');
  if (typeof value !== 'string') throw new InvalidOptionError(`${option}.${key}`, `a label's value is a string, got ${value === null ? 'null' : typeof value}`);
  if (value.length > MAX_LABEL_VALUE_CHARS) throw new InvalidOptionError(`${option}.${key}`, `${value.length} characters; a label's value has at most ${MAX_LABEL_VALUE_CHARS}`);
  if (CONTROL_CHAR.test(value)) throw new InvalidOptionError(`${option}.${key}`, "a label's value has no control characters");
}

/** `KEY=VALUE` (the CLI's `--label`) as one label, checked. */
export function parseLabelText(option: string, text: string): [string, string] {
  const eq = text.indexOf('=');
  if (eq <= 0) throw new InvalidOptionError(option, `expected KEY=VALUE, got ${JSON.stringify(text.slice(0, 80))}`);
  const key = text.slice(0, eq);
  const value = text.slice(eq + 1);
  checkLabel(option, key, value);
  return [key, value];
}

/** Labels given as `KEY=VALUE` words (`--label`), checked as a whole; a key given twice is refused. */
export function labelsFromText(option: string, texts: readonly string[]): Labels {
  const out: Record<string, string> = {};
  for (const t of texts) {
    const [k, v] = parseLabelText(option, t);
    if (Object.hasOwn(out, k)) throw new InvalidOptionError(option, `${k} is given twice`);
    out[k] = v;
  }
  return parseLabels(option, out);
}

/** Whether `labels` has every one of `wanted` (same key, same value). */
export function matchesLabels(labels: Labels, wanted: Labels): boolean {
  return Object.entries(wanted).every(([k, v]) => Object.hasOwn(labels, k) && labels[k] === v);
}

/** Labels as the `pvisor ps` table prints them: `k=v,k2=v2`, or `-`. */
export function formatLabels(labels: Labels): string {
  const words = Object.entries(labels).map(([k, v]) => `${k}=${v}`);
  return words.length ? words.join(',') : '-';
}
