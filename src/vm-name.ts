/**
 * What a VM may be called. A name ends up in file names (backing files, the CLI's control socket),
 * so it is checked once, here, for the library and the CLI alike: a name like `x/../../y` must
 * not reach outside the directory it is meant for.
 */
import { InvalidOptionError } from './errors';

const NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/;

/**
 * Checks a VM name or id: 1-64 letters, digits, `_`, `.`, `-`, beginning with a letter or digit.
 * Throws {@link InvalidOptionError} naming `option` otherwise.
 */
export function validateVmName(name: unknown, option = 'name'): string {
  if (typeof name !== 'string' || !NAME_PATTERN.test(name)) {
    throw new InvalidOptionError(option, `${JSON.stringify(name)} is not a VM id: use 1-64 letters, digits, _ . - beginning with a letter or digit`);
  }
  return name;
}
