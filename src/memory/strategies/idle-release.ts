/**
 * IdleRelease: the guest reports memory it has freed (virtio-balloon free page reporting; the
 * probe's `release`, Linux's page reporting), and the host drops the pages behind it while the VM
 * keeps running. Without this strategy the balloon does not offer reporting at all.
 */
import type { MemoryStrategy, StrategyContext, StrategyStats } from '../strategy';

/**
 * Gives the host back the pages a running guest has freed.
 * @category Strategies
 */
export class IdleRelease implements MemoryStrategy {
  readonly name = 'idle-release';
  readonly needs = [] as const;
  readonly exclusive = ['free-page-reporting'] as const;
  private bytesReleased = 0;
  private reports = 0;

  freePagesReported(ctx: StrategyContext, gpa: number, length: number): void {
    // A freed page's content is undefined: on a private file mapping it may go back to the file's.
    ctx.ram.discard(gpa, length, 'backing');
    this.bytesReleased += length;
    this.reports++;
  }

  stats(): StrategyStats {
    return { strategy: this.name, figures: { pagesReleased: this.bytesReleased / 4096, reports: this.reports }, notes: [] };
  }
}
