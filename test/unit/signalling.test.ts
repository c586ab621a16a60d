import { parseSignalling } from '../../src/backends/kvm/signalling';

describe('virtio signalling choice (PVISOR_VIRTIO_SIGNALLING, bench --signalling)', () => {
  it('reads NOTIFY+INTERRUPT', () => {
    expect(parseSignalling('ioeventfd+irqfd')).toEqual({ notify: 'ioeventfd', interrupt: 'irqfd' });
    expect(parseSignalling('exit+irq-line')).toEqual({ notify: 'exit', interrupt: 'irq-line' });
  });

  it('refuses anything else', () => {
    for (const bad of ['eventfd', 'exit', 'irqfd+ioeventfd', 'exit+irq-line+x', '', 'exit+']) expect(parseSignalling(bad)).toBeUndefined();
  });
});
