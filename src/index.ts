/**
 * pvisor: AI-agent sandboxes in KVM virtual machines that cost the host only the memory they use.
 *
 * ```ts
 * import { Vm } from 'pvisor';
 * await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 });
 * await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 7 });
 * console.log(await vm.probe.digest(), vm.memoryUsage());
 * ```
 * @module
 */
export { Vm } from './vm';
export { VmHandle } from './vm-handle';
export type { ConnectOptions, HandleExecOptions, VmHandleStatus, VmHandleMemoryUsage } from './vm-handle';
export type { VmApi, VmApiEvents } from './vm-api';
export type { VmFiles, VmProcess } from './guest/guest-types';
export type { ControlMemory, ControlVmInfo, ControlErrorPayload } from './control-socket';
export type { VmListEntry } from './vm';
export type { VmListOptions } from './vm-list';
export type { Labels } from './labels';
export type { TimeoutAction } from './lifetime';
export type { JailedVmHandle, JailedVmOptions, JailInfo } from './jail/jailed-vm';
export type { JailOutcome } from './jail/launcher';
export type { JailLimitsInput } from './jail/limits';
export type { Logger, LogFields } from './logger';
export type { VmOptions, RootfsOptions, VmState, VmEvents, VmMemoryUsage, GuestKind, SnapshotOptions, SnapshotInfo, HibernateOptions, HibernateInfo, RestoreOptions, RestoreInfo } from './vm-types';
export { ProbeGuest } from './guest/probe-client';
export { GuestProcess } from './guest/guest-process';
export { GuestFiles } from './guest/linux-client';
export { GuestPty, GuestPtys } from './guest/pty';
export type { PtyCreateOptions, PtySize } from './guest/pty';
export type { GuestProcessInfo } from './guest/process-registry';
export type { OutputMode } from './guest/output-ring';
export type { Command, ExecCommonOptions, ExecOptions, ExecBufferOptions, ExecResult, ExecBufferResult, SpawnOptions, ExitStatus, GuestMemInfo, RequestTimeout, FilesCallOptions, ReadOptions, WriteOptions, ListOptions, StatOptions, MkdirOptions, RemoveOptions } from './guest/guest-types';
export type { DirEntry, FileStat, FileType } from './guest/file-wire';
export type { FillOptions, RewriteOptions, TouchOptions, ReleaseOptions, ZeroOptions, ProbeDigest, ProbeTiming } from './guest/probe-client';
export type { ProbeContent } from './guest/probe-content';
export type { Size } from './units';
export type { WarningLimit } from './warning-limit';
export {
  PvisorError,
  InvalidOptionError,
  HostUnsupportedError,
  SystemCallError,
  GuestCrashError,
  GuestRequestError,
  CommandNotFoundError,
  UnknownUserError,
  GuestFeatureError,
  VmStateError,
  TimeoutError,
  AbortError,
  BackingFileError,
  OutputLimitError,
  RequestTooLargeError,
  SnapshotError,
  StoreError,
  StoreClaimedError,
  PoolUnavailableError,
  VmNotFoundError,
  ControlSocketError,
  ControlProtocolError,
  OptionalDependencyError,
  NetworkSetupError,
  JailUnavailableError,
  VmLimitError,
  JailViolationError,
} from './errors';
export type { StoreErrorReason, StoreClaimInfo } from './errors';
export type { StoreOptions, StoreProgress, StoreTransfer } from './store/store-options';
export type { NetworkOption, NatNetworkOptions, TapNetworkOptions } from './network/options';
export type { VmNetworkInfo } from './network/vm-network';
export type { VmNetwork, EgressRulesUpdate } from './network/vm-network';
export type { ForwardConnections, ForwardOptions, PortForward } from './network/port-forward';
export { IdleRelease } from './memory/strategies/idle-release';
export { ColdCompression, ColdBlockError } from './memory/strategies/cold-compression';
export type { ColdCompressionOptions } from './memory/strategies/cold-compression';
export { KsmAdvice } from './memory/strategies/ksm-advice';
export { Offload } from './memory/strategies/offload';
export type { OffloadOptions, OffloadReload } from './memory/strategies/offload';
export { CompressedOffload } from './memory/strategies/compressed-offload';
export type { CompressedOffloadOptions } from './memory/strategies/compressed-offload';
export { SharedSnapshot } from './memory/strategies/shared-snapshot';
export { PoolClient } from './memory/strategies/pool-client';
export type { PoolClientOptions } from './memory/strategies/pool-client';
export type { SharedSnapshotOptions } from './memory/strategies/shared-snapshot';
export type { BackingDirOptions } from './memory/backing-file';
export { StrategyConflictError } from './memory/strategy';
// What a strategy's user names; what a strategy's author needs is in 'pvisor/strategy' (src/strategy.ts).
export type { MemoryStrategy, StrategyStats } from './memory/strategy';
