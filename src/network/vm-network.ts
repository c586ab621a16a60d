/**
 * What `vm.network` hands out: the VM's network as {@link VmNetworkInfo} says it, and
 * {@link VmNetwork.update}, the change it takes while the VM runs. The work is the host side's
 * (./host-network.ts); this module is only the public face, so that vm.ts needs no more of it.
 */
import { VmStateError } from '../errors';
import type { VmNetworkInfo } from './host-network';

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
   * Hostname rules need the VM to have been started with `allow` or `deny` (so that its resolver
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
