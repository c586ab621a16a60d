/**
 * KsmAdvice: marks private anonymous guest RAM MADV_MERGEABLE so that the kernel's KSM merges
 * identical pages, within a VM and across VMs. Verifies that every guest RAM mapping accepted the
 * advice (VmFlags `mg`), not only that madvise returned 0, and says plainly when KSM is off.
 */
import { existsSync, readFileSync } from 'node:fs';
import { PvisorError } from '../../errors';
import { rangeMappings } from '../../memory-usage';
import { MADV_MERGEABLE, PAGE_SIZE } from '../../sys/constants';
import type { MemoryStrategy, StrategyContext, StrategyStats } from '../strategy';

const KSM_SYSFS = '/sys/kernel/mm/ksm';

function readNumber(path: string): number | undefined {
  try {
    return Number(readFileSync(path, 'utf8').trim());
  } catch {
    return undefined;
  }
}

/**
 * Asks the kernel to merge identical guest pages (KSM).
 * @category Strategies
 */
export class KsmAdvice implements MemoryStrategy {
  readonly name = 'ksm-advice';
  readonly needs = ['ksm-mergeable'] as const;
  readonly exclusive = [] as const;

  map(ctx: StrategyContext): void {
    if (!existsSync(KSM_SYSFS)) throw new PvisorError('PVISOR_KSM_UNAVAILABLE', 'ksm-advice: this kernel has no KSM (/sys/kernel/mm/ksm is missing)');
    ctx.ram.advise(0, ctx.ram.sizeBytes, MADV_MERGEABLE, 'MADV_MERGEABLE');
    const refused = rangeMappings(ctx.ram.hostAddr, ctx.ram.sizeBytes).filter((m) => !m.flags.includes('mg'));
    if (refused.length) {
      const where = refused.map((m) => `0x${m.start.toString(16)}-0x${m.end.toString(16)}`).join(', ');
      throw new PvisorError('PVISOR_KSM_NOT_APPLIED', `ksm-advice: guest RAM mappings ${where} did not accept MADV_MERGEABLE`);
    }
  }

  stats(ctx: StrategyContext): StrategyStats {
    const notes: string[] = [];
    const mappings = rangeMappings(ctx.ram.hostAddr, ctx.ram.sizeBytes);
    const advised = mappings.length > 0 && mappings.every((m) => m.flags.includes('mg'));
    const run = readNumber(`${KSM_SYSFS}/run`);
    if (run !== 1) notes.push(`KSM is not running on this host (${KSM_SYSFS}/run = ${run ?? 'missing'}): nothing will be merged until root writes 1 there`);
    if (!advised) notes.push('guest RAM is not (or no longer) advised mergeable');
    const figures: Record<string, number> = {
      advisedMappings: advised ? mappings.length : 0,
      hostPagesShared: readNumber(`${KSM_SYSFS}/pages_shared`) ?? 0,
      hostPagesSharing: readNumber(`${KSM_SYSFS}/pages_sharing`) ?? 0,
    };
    // Per-mapping KSM bytes need a kernel whose smaps has a KSM line (6.4+); older kernels only
    // count per process, which covers every VM in it.
    if (mappings.every((m) => m.ksmBytes !== undefined)) {
      figures.guestPagesMerged = mappings.reduce((sum, m) => sum + (m.ksmBytes ?? 0), 0) / PAGE_SIZE;
    } else {
      const processMerged = readNumber('/proc/self/ksm_merging_pages');
      if (processMerged !== undefined) {
        figures.processPagesMerged = processMerged;
        notes.push('this kernel counts merged pages per process, not per mapping: processPagesMerged covers every VM in this process');
      }
    }
    return { strategy: this.name, figures, notes };
  }
}
