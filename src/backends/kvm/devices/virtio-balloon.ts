/**
 * virtio-balloon (device id 5) with free page reporting only (VIRTIO_BALLOON_F_FREE_PAGE_REPORTING):
 * the guest hands back ranges it has freed, the host drops the pages behind them. No inflate or
 * deflate: pvisor never asks a guest to give memory up, it takes back what the guest freed.
 */
import { checkVersion, objectAt } from '../../../persist/state-fields';
import { VIRTIO_F_VERSION_1, type VirtioDevice } from '../virtio/mmio-transport';
import type { SplitQueue } from '../virtio/queue';

/** VIRTIO_BALLOON_F_FREE_PAGE_REPORTING (<linux/virtio_balloon.h>). */
export const VIRTIO_BALLOON_F_FREE_PAGE_REPORTING = 1n << 5n;
// With only FREE_PAGE_REPORTING negotiated the queues are inflate 0, deflate 1, reporting 2:
// the driver skips absent queues without using up an index.
const REPORTING_QUEUE = 2;

/** What the host does with a reported range; the default drops its pages. */
export type FreePageSink = (gpa: number, len: number) => void;

/** The version of {@link BalloonState} this code writes and reads. */
export const BALLOON_STATE_VERSION = 1;

/**
 * The balloon's saved state: nothing beyond its version. A report is handled whole when the
 * guest notifies (the pages are dropped before the chain goes back used), so none is ever half
 * done; whether reporting was negotiated is in the transport's acked features.
 */
export interface BalloonState {
  version: typeof BALLOON_STATE_VERSION;
}

/** Free page reporting device model. */
export class VirtioBalloon implements VirtioDevice {
  readonly deviceId = 5;
  readonly queueCount = 3;
  readonly features: bigint;
  private reporting: SplitQueue | null = null;

  constructor(
    private readonly sink: FreePageSink,
    private readonly onUsed: () => void,
    private readonly onError: (message: string) => void,
    reportingEnabled = true,
  ) {
    this.features = VIRTIO_F_VERSION_1 | (reportingEnabled ? VIRTIO_BALLOON_F_FREE_PAGE_REPORTING : 0n);
  }

  readConfig(): number {
    // num_pages and actual are 0: the host never asks for a balloon.
    return 0;
  }

  activate(queues: (SplitQueue | null)[], acked: bigint): void {
    this.reporting = acked & VIRTIO_BALLOON_F_FREE_PAGE_REPORTING ? queues[REPORTING_QUEUE] : null;
  }

  reset(): void {
    this.reporting = null;
  }

  /** Whether the driver negotiated free page reporting and its queue is live. */
  get reportingActive(): boolean {
    return this.reporting !== null;
  }

  saveState(): BalloonState {
    return { version: BALLOON_STATE_VERSION };
  }

  restoreState(value: unknown, queues: (SplitQueue | null)[], acked: bigint, path: string): void {
    checkVersion(objectAt(value, path), path, BALLOON_STATE_VERSION);
    this.activate(queues, acked);
  }

  notify(index: number): void {
    if (index !== REPORTING_QUEUE || !this.reporting) return;
    const q = this.reporting;
    const usedBefore = q.usedIndex;
    let chain;
    while ((chain = q.popValid((message) => this.onError(`virtio-balloon: ${message}`)))) {
      for (const d of chain.descriptors) {
        try {
          this.sink(d.gpa, d.len);
        } catch (e) {
          this.onError(`virtio-balloon: report 0x${d.gpa.toString(16)}+${d.len}: ${(e as Error).message}`);
        }
      }
      q.push(chain.head, 0);
    }
    if (q.shouldInterrupt(usedBefore)) this.onUsed();
  }
}
