import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { HostUnsupportedError } from './errors';

/** Root of the package (where package.json and native-prebuilds/ live), from src/ or dist/src/. */
export const PACKAGE_ROOT = [join(__dirname, '..'), join(__dirname, '..', '..')].find((d) => existsSync(join(d, 'native-prebuilds')))
  ?? join(__dirname, '..', '..');

/** Path of a prebuilt artifact shipped for this platform; throws if the platform has none. */
export function nativePrebuild(name: string): string {
  if (process.platform !== 'linux' || process.arch !== 'x64') {
    throw new HostUnsupportedError(`pvisor ships native parts for linux-x64 only; this is ${process.platform}-${process.arch}`);
  }
  return join(PACKAGE_ROOT, 'native-prebuilds', 'linux-x64', name);
}

/**
 * How the bytes of a shipped artifact at `path` differ from its checksum file (`path`.sha256,
 * beside it): a sentence to put in the caller's error, or undefined when they match.
 */
export function prebuildMismatch(path: string, bytes: Buffer): string | undefined {
  const expected = readFileSync(`${path}.sha256`, 'utf8').split(/\s+/)[0];
  const actual = createHash('sha256').update(bytes).digest('hex');
  return actual === expected ? undefined : `${path} does not match its checksum (${actual} != ${expected})`;
}
