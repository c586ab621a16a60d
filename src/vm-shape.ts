/**
 * The shape of a VM (guest RAM, vCPUs, guest), checked before anything is allocated: by
 * {@link Vm.start}, by `pvisor run` before it prints or starts anything, and by {@link Vm.restore}
 * on what a snapshot says, with the same rules and the same messages.
 */
import { InvalidOptionError } from './errors';
import { hostMemTotalBytes } from './memory-usage';
import { parseSize, type Size } from './units';
import type { GuestKind } from './vm-types';

/** The most vCPUs a VM may have. */
export const MAX_VCPUS = 8;

/** A checked shape. */
export interface VmShape {
  memoryBytes: number;
  vcpus: number;
  guest: GuestKind;
}

/** Checks the shape; a wrong part is an {@link InvalidOptionError} naming it. Defaults: 512 MiB, 2 vCPUs, Linux. */
export function checkVmShape(options: { memory?: Size; vcpus?: number; guest?: string }): VmShape {
  const memoryBytes = checkGuestMemoryBytes(parseSize('memory', options.memory ?? '512MiB'));
  const vcpus = options.vcpus ?? 2;
  if (!Number.isInteger(vcpus) || vcpus < 1 || vcpus > MAX_VCPUS) throw new InvalidOptionError('vcpus', `must be a whole number from 1 to ${MAX_VCPUS}, got ${vcpus}`);
  const guest = options.guest ?? 'linux';
  if (guest !== 'linux' && guest !== 'probe') throw new InvalidOptionError('guest', `expected "linux" or "probe", got ${JSON.stringify(guest)}`);
  return { memoryBytes, vcpus, guest };
}

/**
 * Checks guest RAM's size alone (the `memory` part of {@link checkVmShape}): a non-zero multiple of
 * 4 KiB, no larger than this host's RAM. A restore checks it from the snapshot's manifest before
 * it reads anything whose size follows from it.
 */
export function checkGuestMemoryBytes(memoryBytes: number): number {
  if (memoryBytes === 0 || memoryBytes % 4096 !== 0) throw new InvalidOptionError('memory', `must be a non-zero multiple of 4 KiB, got ${memoryBytes} bytes`);
  const hostBytes = hostMemTotalBytes();
  if (memoryBytes > hostBytes) throw new InvalidOptionError('memory', `${memoryBytes} bytes is more than this host has (${hostBytes} bytes)`);
  return memoryBytes;
}
