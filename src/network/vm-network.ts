/**
 * What `vm.network` hands out: the VM's network as {@link VmNetworkInfo} says it, and
 * {@link VmNetwork.update}, the change it takes while the VM runs. The work is the host side's
 * (./host-network.ts); this module is only the public face, so that vm.ts needs no more of it.
 */
import { VmStateError } from '../errors';

/**
 * What {@link Vm.network} says of a VM's network.
 * @category Network
 */
export interface VmNetworkInfo {
  /** `none`: no network device. */
  mode: 'none' | 'nat' | 'tap';
  /** The TAP on the host. */
  tap?: string;
  /** The guest's MAC address. */
  mac?: string;
  /** The guest's eth0 address with its prefix, e.g. `10.200.0.2/30`. */
  guestAddress?: string;
  /** The host's end (the guest's gateway), e.g. `10.200.0.1`. */
  hostAddress?: string;
  /** The resolver the guest was given (with egress rules, pvisor's: the host's end of the TAP). */
  dns?: string;
  /** `nat` with egress rules: the resolver pvisor's asks; absent if there is none. */
  upstreamDns?: string;
  /** `nat`: the destinations the guest may reach (`all`, or the hostname and CIDR[:PORT] list). */
  allow?: 'all' | string[];
  /** `nat`: the destinations it may not, whatever `allow` says. */
  deny?: string[];
  /** `nat`: the name of the VM's nftables tables (families inet and netdev). */
  nftTable?: string;
}

/**
 * The rules {@link VmNetwork.update} takes: each list given replaces the VM's; one left out stays.
 * @category Network
 */
export interface EgressRulesUpdate {
  /** Hostnames, `*.domain`, `CIDR` and `CIDR:PORT` the guest may reach (see `NatNetworkOptions.allow`). */
  allow?: readonly string[];
  /** What it may not, whatever `allow` says. */
  deny?: readonly string[];
}

/**
 * {@link Vm.network}: what the VM's network is, and the change it takes while the VM runs.
 * @category Network
 */
export class VmNetwork implements VmNetworkInfo {
  declare mode: VmNetworkInfo['mode'];
  declare tap?: string;
  declare mac?: string;
  declare guestAddress?: string;
  declare hostAddress?: string;
  declare dns?: string;
  declare upstreamDns?: string;
  declare allow?: 'all' | string[];
  declare deny?: string[];
  declare nftTable?: string;
  readonly #update: (rules: EgressRulesUpdate) => Promise<void>;

  /** @internal */
  constructor(info: VmNetworkInfo, update: (rules: EgressRulesUpdate) => Promise<void>) {
    Object.assign(this, info);
    this.#update = update;
  }

  /**
   * Replaces the egress rules of a `'nat'` VM while it runs: each list given replaces the VM's
   * (`allow: []` denies everything), one left out stays as it is. The lists are checked whole
   * before anything changes ({@link InvalidOptionError} naming the bad entry). Once this
   * resolves, new connections follow the new rules, and addresses the resolver had opened for
   * names no longer allowed (or now denied) are closed; connections already made go on.
   * Hostname rules need the VM to have been started with a hostname rule in `allow` or `deny` (so that its resolver
   * is pvisor's); a VM started with plain `'nat'` takes CIDR rules only.
   *
   * @throws {@link VmStateError} when the VM has no `'nat'` network (or it has stopped).
   * @throws {@link InvalidOptionError} for a bad entry, or a hostname rule on a VM without pvisor's resolver.
   * @throws {@link NetworkSetupError} when nft refused the change (the old rules stay).
   */
  update(rules: EgressRulesUpdate): Promise<void> {
    return this.#update(rules);
  }
}

/** The `network` of a VM without one (`'none'`): nothing to update. */
export function noNetwork(): VmNetwork {
  return new VmNetwork({ mode: 'none' }, () => Promise.reject(new VmStateError("the VM has no network (network: 'none'): there are no egress rules to update")));
}
