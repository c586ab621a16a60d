/**
 * `pvisor/strategy`: what a memory strategy's author needs. A strategy implements
 * {@link MemoryStrategy}; the KVM backend calls its hooks when guest RAM is mapped, on suspend and
 * resume, and periodically, with a {@link StrategyContext} that reaches guest RAM and, for a
 * strategy that asks for it, the VM's userfaultfd server. The built-in strategies are written
 * against exactly this surface (src/memory/strategies/idle-release.ts is the shortest).
 *
 * ```ts
 * import type { MemoryStrategy, StrategyContext } from 'pvisor/strategy';
 * ```
 * @module
 */
export { StrategyConflictError } from './memory/strategy';
export type {
  MemoryStrategy,
  StrategyContext,
  StrategyRam,
  StrategyStats,
  ExclusiveResource,
  SuspendWork,
  PeriodicWork,
  PageRun,
  FileRunOver,
  DiscardTo,
  RamBackingKind,
  RamBackingRequest,
  RamCapability,
} from './memory/strategy';
// Types only: the server's native code loads when a strategy first asks for it.
export type {
  UffdServer,
  UffdSource,
  UffdSourceSpec,
  UffdSourceEvent,
  UffdSourceFigures,
  UffdServerFigures,
  FileRange,
  ZeroRange,
  MemoryRange,
  RangeState,
  ColdStore,
  ColdScan,
  ColdStoreFigures,
  ColdOutcome,
  ColdState,
} from './memory/uffd-server';
