/**
 * A VM network whose host side another process set up and handed over: a jailed VMM's. Its
 * launcher (root, in the host's network namespace) makes the TAP, its kernel settings and its
 * nftables tables as an in-process VM's start does (./host-network.ts), and passes the jailed
 * VMM the TAP's open fd (inherited) and this description in its environment. The jailed VMM has
 * no CAP_NET_ADMIN, no /dev/net/tun and a network namespace of its own: it can only attach the
 * fd to vhost-net. The launcher keeps the rules and removes them, and its copy of the fd, when
 * the VMM ends however it ends.
 *
 * The description comes from the launcher (bubblewrap clears every other variable), so it is
 * trusted; it is still checked whole, so that a mistake is a typed error, not a guest with a
 * wrong address.
 */
import { NetworkSetupError } from '../errors';
import { parseMac } from './addresses';
import type { VmNetworkInfo } from './vm-network';

/** The environment variable that carries the description into the jail. */
export const HANDED_NETWORK_ENV = 'PVISOR_JAIL_NETWORK';

/** What the jailed VMM is told of the network its launcher made. */
export interface HandedNetwork {
  /** The TAP's fd in the jailed process (TUNSETIFF and TUNSETVNETHDRSZ already done). */
  tapFd: number;
  /** `pvisor.net=...` for the guest's kernel command line, when the guest is to configure eth0. */
  kernelArg?: string;
  /** What `vm.network` says (the TAP's name, the guest's MAC and addresses, the rules). */
  info: VmNetworkInfo & { tap: string; mac: string };
}

/** What a launcher that made no network hands over: the jailed VMM then refuses to make one. */
export const NO_HANDED_NETWORK = 'none';

/** The description's text. Pure. */
export function formatHandedNetwork(handed: HandedNetwork | undefined): string {
  return handed === undefined ? NO_HANDED_NETWORK : JSON.stringify(handed);
}

/**
 * The network this process was handed (`env`'s {@link HANDED_NETWORK_ENV}): `undefined` when this
 * process is no jailed VMM (it sets its network up itself), `null` when its launcher made none.
 * Throws a {@link NetworkSetupError} for a description that is not one. Pure.
 */
export function handedNetwork(env: NodeJS.ProcessEnv = process.env): HandedNetwork | null | undefined {
  const text = env[HANDED_NETWORK_ENV];
  if (text === undefined) return undefined;
  if (text === NO_HANDED_NETWORK) return null;
  const bad = (why: string) => new NetworkSetupError('failed', `${HANDED_NETWORK_ENV}: ${why}`);
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    throw bad('not JSON');
  }
  const o = v as Partial<HandedNetwork> | null;
  if (typeof o !== 'object' || o === null) throw bad('expected an object');
  if (!Number.isSafeInteger(o.tapFd) || o.tapFd! < 3 || o.tapFd! > 1023) throw bad(`tapFd: expected a file descriptor from 3 to 1023, got ${JSON.stringify(o.tapFd)}`);
  if (o.kernelArg !== undefined && (typeof o.kernelArg !== 'string' || !/^pvisor\.net=[0-9.,/]{1,80}$/.test(o.kernelArg))) throw bad(`kernelArg: expected pvisor.net=ADDRESS/PREFIX,GATEWAY[,DNS], got ${JSON.stringify(o.kernelArg)}`);
  const info = o.info;
  if (typeof info !== 'object' || info === null) throw bad('info: expected an object');
  if (info.mode !== 'nat' && info.mode !== 'tap') throw bad(`info.mode: expected nat or tap, got ${JSON.stringify(info.mode)}`);
  if (typeof info.tap !== 'string' || !/^[A-Za-z0-9_.-]{1,15}$/.test(info.tap)) throw bad(`info.tap: expected an interface name, got ${JSON.stringify(info.tap)}`);
  if (typeof info.mac !== 'string' || !parseMac(info.mac)) throw bad(`info.mac: expected a unicast MAC address, got ${JSON.stringify(info.mac)}`);
  return { tapFd: o.tapFd!, ...(o.kernelArg !== undefined && { kernelArg: o.kernelArg }), info: info as HandedNetwork['info'] };
}
