/**
 * zstd-napi's native binding, loaded on first use. It is an optional dependency: its install
 * compiles it from source (its prebuilt download is unreachable from many hosts), so a host
 * without python3, make and g++ installs pvisor without it. Only CompressedOffload needs it; its
 * absence is an {@link OptionalDependencyError} that says how to get it, and nothing else notices.
 * Both threads that compress load it here: the main thread (the frame pool) and each worker.
 */
import type * as Zstd from 'zstd-napi/binding';
import { OptionalDependencyError } from '../errors';

/** What pvisor uses of zstd-napi: compression contexts and the bound. */
export type ZstdBinding = typeof Zstd;

/** How to get the binding, for the error. */
export const ZSTD_INSTALL_HINT = 'run `npm install zstd-napi` where python3, make and g++ are installed (it compiles zstd from source)';

let binding: ZstdBinding | undefined;

/** The binding; throws {@link OptionalDependencyError} naming what `feature` needs if it cannot load. */
export function loadZstd(feature = 'CompressedOffload'): ZstdBinding {
  if (binding) return binding;
  try {
    // require, not import: an import would load the addon with the module that imports this one.
    binding = require('zstd-napi/binding') as ZstdBinding;
  } catch (e) {
    throw new OptionalDependencyError('zstd-napi', feature, ZSTD_INSTALL_HINT, { cause: e });
  }
  return binding;
}
