/**
 * How virtio devices and a Linux guest signal each other, two independent choices:
 * - queue notifications: `ioeventfd` (the guest's QueueNotify write completes inside KVM; a native
 *   thread reports it) or `exit` (an MMIO exit, handled before the vCPU goes on);
 * - interrupts: `irqfd` (one write(2); KVM injects from a kernel worker) or `irq-line` (two
 *   KVM_IRQ_LINE calls, injected at once).
 * The probe guest polls and always uses exits and no interrupts. `PVISOR_VIRTIO_SIGNALLING`
 * (e.g. `exit+irq-line`) overrides the default, which `pvisor bench linux` measures against the
 * others.
 */
import { InvalidOptionError } from '../../errors';

/** See the module comment. */
export interface VirtioSignalling {
  notify: 'ioeventfd' | 'exit';
  interrupt: 'irqfd' | 'irq-line';
}

/**
 * What pvisor uses unless told otherwise. `pvisor bench linux` in the nested harness, all four
 * pairs interleaved, 3 fresh VMs each, medians (ioeventfd+irqfd / ioeventfd+irq-line /
 * exit+irqfd / exit+irq-line): guest to host 7.5 / 14.8 / 5.3 / 3.9 MiB/s, host to guest
 * 24.5 / 20.2 / 22.5 / 17.0 MiB/s, exec round trip 32 / 30 / 32 / 26 ms, boot to agent ready
 * 5.0 / 5.6 / 4.9 / 3.9 s. An ioeventfd wins the bulk transfers (the guest's vCPU never stops for
 * a notification); between irqfd and KVM_IRQ_LINE the figures are split and noisy, and an irqfd
 * costs the event loop one write(2) instead of two ioctls through ffi-rs. Exits also wedged the
 * nested harness's L1 more often.
 */
export const DEFAULT_SIGNALLING: VirtioSignalling = { notify: 'ioeventfd', interrupt: 'irqfd' };

/** `NOTIFY+INTERRUPT`, e.g. `exit+irq-line`: the format of PVISOR_VIRTIO_SIGNALLING and the bench. */
export function parseSignalling(text: string): VirtioSignalling | undefined {
  const [notify, interrupt, extra] = text.split('+');
  if (extra !== undefined || (notify !== 'ioeventfd' && notify !== 'exit') || (interrupt !== 'irqfd' && interrupt !== 'irq-line')) return undefined;
  return { notify, interrupt };
}

/** PVISOR_VIRTIO_SIGNALLING, or {@link DEFAULT_SIGNALLING}; a malformed value is an {@link InvalidOptionError}. */
export function signallingFromEnv(): VirtioSignalling {
  const v = process.env.PVISOR_VIRTIO_SIGNALLING;
  if (v === undefined || v === '') return DEFAULT_SIGNALLING;
  const parsed = parseSignalling(v);
  if (!parsed) throw new InvalidOptionError('PVISOR_VIRTIO_SIGNALLING', `must be NOTIFY+INTERRUPT with NOTIFY ioeventfd or exit and INTERRUPT irqfd or irq-line, not "${v}"`);
  return parsed;
}
