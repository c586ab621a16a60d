/**
 * One KVM virtual machine: guest RAM, vCPU threads, the exit loop and the device models. It knows
 * nothing of the agent protocol or of memory strategies: `Vm` composes those on top.
 */
import { writeSync } from 'node:fs';
import { GuestCrashError, InvalidOptionError, PvisorError, SnapshotError, SystemCallError, VmStateError } from '../../errors';
import * as C from '../../sys/constants';
import { closeFd, createEventFd, EVENTFD_ONE } from '../../sys/libc';
import { CmosRtc, CMOS_BASE, CMOS_PORTS, type CmosState } from './devices/cmos-rtc';
import { Serial8250, COM1_BASE, COM1_IRQ, COM1_PORTS, type SerialState } from './devices/serial';
import { ProbeDoorbell, PROBE_DOORBELL_BASE, PROBE_DOORBELL_SIZE } from './devices/probe-doorbell';
import { DeviceManager, virtioStatesOf, type DeviceOptions, type VirtioDeviceState } from './device-manager';
import type { VirtioConsole } from './devices/virtio-console';
import { signallingFromEnv, type VirtioSignalling } from './signalling';
import type { RamBacking } from '../../guest-ram/ram-backing';
import { GuestMemory } from './guest-memory';
import { IoBus, type VcpuAction } from './io-bus';
import { Kvm, VmFd, VcpuFd } from './ioctls';
import { cpuidForVcpu, loadLinux, setupLapic, setupLinuxBootVcpu } from './linux-boot';
import { loadProbe, setupProbeVcpu } from './probe-boot';
import { MACHINE_STATE_VERSION, parseMachineState, type MachineState, type VcpuActivity } from './machine-state';
import { RecordKind, VcpuRunner, loadVcpuRunner, type VcpuRecord } from './vcpu-runner';
import { captureVcpu, checkVcpuStateFits, restoreVcpu, vcpuStateFormat, type VcpuStateFormat } from './vcpu-state';
import { captureVm, checkVmStateFits, restoreVm } from './vm-state';
import { objectAt } from '../../persist/state-fields';
import { linuxShutdownCrash, quoteConsole } from './console-claims';

// Resolve the runner's native functions while this module loads, on the main thread.
loadVcpuRunner();

/** Identity-map/TSS pages Intel VMX wants somewhere unused in the guest-physical space. */
const TSS_GPA = 0xfffbd000;

/** What a machine tells its owner. */
export interface MachineHooks {
  /** A line the guest printed on its serial console. */
  onConsole(line: string): void;
  /** Bytes the guest sent on the agent channel. */
  onAgentData(bytes: Buffer): void;
  /** The guest crashed or misbehaved; the machine has already been torn down. */
  onCrash(error: PvisorError): void;
  /** A device saw a malformed request; the request was refused and the guest goes on. */
  onDeviceError(message: string): void;
  /**
   * The machine is ending (stop or crash): called once, when exits are no longer handled but
   * before vCPU threads are joined and guest RAM is unmapped. Whatever can hold a vCPU thread
   * outside KVM_RUN's reach (a userfaultfd fault) must release it here, or the join would hang.
   */
  onEnding?(): void;
}

/** Which guest a machine is built for: it decides the interrupt controller and the signalling. */
export type MachineGuest = 'probe' | 'linux';

/** What {@link KvmMachine.boot} loads. */
export type MachineBoot =
  /** The probe guest's flat image, entered at CPL3; it polls, so no interrupt controller. */
  | { kind: 'probe'; image: Buffer }
  /**
   * A Linux bzImage with an in-kernel irqchip and PIT; the machine appends its devices to
   * `cmdline` (virtio_mmio.device=...).
   */
  | { kind: 'linux'; kernel: Buffer; initrd?: Buffer; cmdline: string };

/**
 * What to build: the machine's description. Building makes RAM, devices and vCPUs; it neither
 * loads a guest nor sets registers, so the machine can then be booted or given saved state.
 */
export interface MachineConfig extends DeviceOptions {
  memoryBytes: number;
  vcpus: number;
  guest: MachineGuest;
  /**
   * Opens guest RAM's backing (the memory layer's choice); called once, right before RAM is
   * mapped, which takes over its fd. Default: private anonymous memory.
   */
  openRamBacking?: () => RamBacking;
  /** Linux guest only; default from PVISOR_VIRTIO_SIGNALLING, else {@link DEFAULT_SIGNALLING}. */
  signalling?: VirtioSignalling;
}

/**
 * The version of {@link DevicesState} this code writes. It reads version 1 too (see
 * {@link virtioStatesOf}).
 */
export const DEVICES_STATE_VERSION = 2;

/** Every device of a machine, as {@link KvmMachine.captureDevices} saves them. */
export interface DevicesState {
  version: typeof DEVICES_STATE_VERSION;
  serial: SerialState;
  /** The RTC (the Linux machine only). */
  cmos?: CmosState;
  /** Every virtio device, each with its role and slot (see device-manager.ts). */
  virtio: VirtioDeviceState[];
}

/** `settling`: in KVM_RUN with immediate_exit set, only to finish its last exit (see {@link KvmMachine.captureState}). */
type VcpuState = 'created' | 'running' | 'held' | 'idle' | 'parked' | 'settling';

interface Vcpu {
  fd: VcpuFd;
  state: VcpuState;
  seenUsedIndex: number;
}

/** A running (or paused) KVM VM. */
export class KvmMachine {
  readonly memory: GuestMemory;
  private readonly devices: DeviceManager;
  /** The agent channel: bytes to the guest, and what an idle vCPU waits for. */
  private readonly console: VirtioConsole;
  /** Booted or restored: a machine is either, once. */
  private prepared = false;
  private readonly serial: Serial8250;
  private readonly rtc: CmosRtc | undefined;
  private readonly pio = new IoBus('pio');
  private readonly mmio = new IoBus('mmio');
  private readonly vcpus: Vcpu[] = [];
  private readonly runner: VcpuRunner;
  private pausing = false;
  private pauseWaiters: (() => void)[] = [];
  private ended = false;
  /** Queue notifications (record tags) that arrived while paused. */
  private heldNotifies = new Set<number>();
  /** Device state was restored: pending interrupts are raised again at the next resume. */
  private restoredInterrupts = false;
  /** The serial line's irqfd, closed once the vCPU threads are gone. */
  private serialIrqFd: number | undefined;
  private readonly linux: boolean;
  /** The guest's last console lines, to say why a Linux guest ended. */
  private readonly recentConsole: string[] = [];
  /** KVM_GET_SUPPORTED_CPUID, as the vCPUs were given it. */
  private readonly cpuid: Buffer;
  /** What this host saves of a vCPU; found at the first capture or restore. */
  private stateFormat: VcpuStateFormat | undefined;
  /** vCPUs finishing their last exit, and what each goes back to (see {@link settleVcpu}). */
  private readonly settling = new Map<number, { resume: VcpuState; resolve: () => void; reject: (e: Error) => void }>();

  private constructor(
    private readonly kvm: Kvm,
    private readonly vm: VmFd,
    config: MachineConfig,
    private readonly hooks: MachineHooks,
  ) {
    this.memory = GuestMemory.map(config.memoryBytes, config.openRamBacking?.(), () => this.crash(this.ramLostError()!));
    try {
      this.memory.register(vm);
      const linux = (this.linux = config.guest === 'linux');
      if (linux) {
        vm.createIrqchip();
        vm.createPit2();
      }
      const signalling = linux ? config.signalling ?? signallingFromEnv() : 'polled';
      ({ serial: this.serial, rtc: this.rtc } = this.platformDevices(signalling));

      if (config.net && !linux) throw new InvalidOptionError('network', 'only the Linux guest has a network device');
      const host = {
        memory: this.memory,
        onAgentData: (b: Buffer) => this.hooks.onAgentData(b),
        onAgentDelivered: () => this.wakeIdle(),
        onDeviceError: (m: string) => this.hooks.onDeviceError(m),
        // Work a queue's budget left for a later turn is a notification like any other: held
        // while the machine is paused, dropped once it has stopped.
        goOnLater: (tag: number) => {
          if (this.ended) return;
          if (this.pausing) this.heldNotifies.add(tag);
          else this.devices.notify(tag);
        },
      };
      this.devices = new DeviceManager(config, host, vm, signalling, this.mmio);
      this.console = this.devices.get('console')!;

      this.runner = new VcpuRunner((rec) => this.onRecord(rec));
      this.cpuid = kvm.supportedCpuid();
      this.createVcpus(config.vcpus);
      this.devices.watchNotifications((fd, tag) => this.runner.watch(fd, tag));
    } catch (e) {
      this.releaseGuest(); // the VM and KVM fds are closed by create()
      throw e;
    }
  }

  /** The UART on COM1, and the RTC (Linux) or the probe's doorbell: the machine's own devices. */
  private platformDevices(signalling: VirtioSignalling | 'polled'): { serial: Serial8250; rtc: CmosRtc | undefined } {
    const serial = new Serial8250((line) => {
      this.recentConsole.push(line);
      if (this.recentConsole.length > 50) this.recentConsole.shift();
      this.hooks.onConsole(line);
    }, signalling === 'polled' ? () => {} : this.serialInterrupt(signalling));
    this.pio.add(COM1_BASE, COM1_PORTS, { read: (o) => serial.read(o), write: (o, _s, v) => serial.write(o, v) });
    if (!this.linux) {
      // The probe uses no port I/O (kvm_pvm clears IOPL): it prints and parks through its doorbell.
      this.mmio.add(PROBE_DOORBELL_BASE, PROBE_DOORBELL_SIZE, new ProbeDoorbell((byte) => serial.write(0, byte)));
      return { serial, rtc: undefined };
    }
    const rtc = new CmosRtc();
    this.pio.add(CMOS_BASE, CMOS_PORTS, { read: (o) => rtc.read(o), write: (o, _s, v) => rtc.write(o, v) });
    return { serial, rtc };
  }

  /** `count` vCPUs with their CPUID (and, for Linux, their local APIC), each with its runner thread. */
  private createVcpus(count: number): void {
    const mmapSize = this.kvm.vcpuMmapSize();
    for (let i = 0; i < count; i++) {
      const fd = this.vm.createVcpu(i, mmapSize);
      this.vcpus.push({ fd, state: 'created', seenUsedIndex: 0 });
      if (this.linux) {
        fd.setCpuid(cpuidForVcpu(this.cpuid, i));
        setupLapic(fd);
      } else fd.setCpuid(this.cpuid);
      this.runner.start(i, fd.fd, fd.runAddr);
    }
  }

  /**
   * Loads the guest into RAM and sets up its vCPUs' registers, once, on a machine just built;
   * {@link start} then runs it.
   */
  boot(boot: MachineBoot): void {
    this.prepare(boot.kind);
    const vcpus = this.vcpus.length;
    if (boot.kind === 'probe') {
      const layout = this.devices.layout;
      const info = { consoleMmio: layout.slot('console').base, balloonMmio: layout.slot('balloon').base, vcpuCount: vcpus };
      loadProbe(this.memory, boot.image, info);
      this.vcpus.forEach((v, i) => setupProbeVcpu(v.fd, i));
      return;
    }
    const cmdline = `${boot.cmdline} ${this.devices.linuxCmdline()}`;
    const entry = loadLinux(this.memory, { kernel: boot.kernel, initrd: boot.initrd, vcpus, cmdline });
    // Application processors stay in wait-for-SIPI inside KVM until the kernel starts them.
    setupLinuxBootVcpu(this.vcpus[0].fd, entry);
  }

  /**
   * Gives a machine just built the state a snapshot saved, instead of booting it: device state
   * (see {@link restoreDevices}), then the KVM state (see {@link restoreState}). Guest RAM must
   * already hold the snapshot's bytes. The machine is then paused; {@link resume} runs it. A
   * state that does not fit is a {@link SnapshotError}; the machine must then be stopped.
   */
  async restoreSaved(saved: { machine: unknown; devices: unknown }): Promise<void> {
    this.prepare(this.linux ? 'linux' : 'probe');
    this.pausing = true;
    this.devices.pause();
    this.restoreDevices(saved.devices);
    await this.restoreState(saved.machine);
  }

  private prepare(guest: MachineGuest): void {
    if (this.prepared) throw new VmStateError('this machine has already been booted or restored');
    if ((guest === 'linux') !== this.linux) throw new VmStateError(`this machine was built for the ${this.linux ? 'linux' : 'probe'} guest, not ${guest}`);
    this.prepared = true;
  }

  /** Creates the VM with its RAM, devices and vCPUs: nothing runs until it is booted or restored. */
  static create(config: MachineConfig, hooks: MachineHooks, kvmPath: string): KvmMachine {
    const kvm = Kvm.open(kvmPath);
    let vm: VmFd | undefined;
    try {
      const api = kvm.apiVersion();
      if (api !== C.KVM_API_VERSION) throw new PvisorError('PVISOR_HOST_UNSUPPORTED', `KVM API version ${api}, expected ${C.KVM_API_VERSION}`);
      vm = kvm.createVm();
      try {
        vm.setTssAddr(TSS_GPA);
      } catch {
        // Only Intel VMX needs it; other KVMs may refuse it.
      }
      return new KvmMachine(kvm, vm, config, hooks);
    } catch (e) {
      vm?.close();
      kvm.close();
      throw e;
    }
  }

  /** Lets every vCPU of a booted machine run. */
  start(): void {
    if (!this.prepared) throw new VmStateError('boot the machine before starting it');
    for (let i = 0; i < this.vcpus.length; i++) this.continueVcpu(i);
  }

  /** Stops every vCPU and resolves once none is inside KVM_RUN. */
  pause(): Promise<void> {
    this.pausing = true;
    this.devices.pause();
    for (let i = 0; i < this.vcpus.length; i++) if (this.vcpus[i].state === 'running') this.runner.kick(i);
    return new Promise((resolve) => {
      this.pauseWaiters.push(resolve);
      this.checkPaused();
    });
  }

  /** Lets paused vCPUs run again and delivers agent bytes and notifications held while paused. */
  resume(): void {
    if (this.settling.size > 0) throw new VmStateError('the machine is capturing or restoring its state: resume after it has finished');
    this.pausing = false;
    const notifies = [...this.heldNotifies];
    this.heldNotifies.clear();
    for (const tag of notifies) this.onRecord({ index: tag, kind: RecordKind.Notify, err: 0 });
    if (this.restoredInterrupts) {
      this.restoredInterrupts = false;
      this.devices.raisePendingInterrupts();
    }
    for (let i = 0; i < this.vcpus.length; i++) if (this.vcpus[i].state === 'held') this.continueVcpu(i);
    // The console takes its transmit queue again and delivers what was held for the guest.
    this.devices.resume();
  }

  /** Whether the network device's data path is attached to its TAP now (detached while paused). */
  get networkServing(): boolean {
    return this.devices.get('net')?.serving ?? false;
  }

  /**
   * The KVM-side state of the paused machine: the VM's (irqchip, PIT, kvm-clock) and every
   * vCPU's, and where the VMM had left each vCPU. Each vCPU that stopped on an exit first enters
   * KVM_RUN once with immediate_exit set, which completes that exit's instruction (KVM writes an
   * MMIO read's value into its register, or moves RIP past a write) and returns before any guest
   * code runs: captured earlier, a restore would replay the access.
   */
  async captureState(): Promise<MachineState> {
    this.requirePausedFor('capture');
    await this.settleVcpus();
    this.requirePausedFor('capture');
    const format = this.vcpuStateFormat();
    return {
      version: MACHINE_STATE_VERSION,
      vm: captureVm(this.vm, this.linux),
      vcpus: this.vcpus.map((v) => ({ kvm: captureVcpu(v.fd, format), activity: activityOf(v) })),
    };
  }

  /**
   * Puts a state from {@link captureState} (of this machine, or of one built the same way) back
   * into the paused machine; it continues from there at {@link resume}. `value` is checked whole
   * first: a malformed description, another version, or one this machine cannot take (another
   * vCPU count, irqchip or state format) is a {@link SnapshotError} before any ioctl. A value KVM
   * then refuses is a {@link SnapshotError} naming its field (e.g. `machine.vcpus[0].kvm.mpState`);
   * the machine is half restored and must be stopped. Device state and guest RAM are not part of it.
   */
  async restoreState(value: unknown): Promise<void> {
    this.requirePausedFor('restore');
    const state = parseMachineState(value);
    if (state.vcpus.length !== this.vcpus.length) throw new SnapshotError(`machine.vcpus: the state has ${state.vcpus.length} vCPUs, this machine ${this.vcpus.length}`);
    const format = this.vcpuStateFormat();
    checkVmStateFits(state.vm, this.linux, 'machine.vm');
    state.vcpus.forEach((v, i) => checkVcpuStateFits(v.kvm, format, `machine.vcpus[${i}].kvm`));
    // A vCPU with an exit half-done would finish it on the restored registers at its next KVM_RUN.
    await this.settleVcpus();
    this.requirePausedFor('restore');
    restoreVm(this.vm, state.vm, 'machine.vm');
    state.vcpus.forEach((v, i) => {
      restoreVcpu(this.vcpus[i].fd, v.kvm, `machine.vcpus[${i}].kvm`);
      this.setActivity(i, v.activity);
    });
  }

  /**
   * The paused machine's device state: the UART, the RTC when there is one, and every virtio
   * device with its role and slot (see {@link DevicesState}).
   */
  captureDevices(): DevicesState {
    this.requirePausedFor('capture');
    return {
      version: DEVICES_STATE_VERSION,
      serial: this.serial.saveState(),
      ...(this.rtc && { cmos: this.rtc.saveState() }),
      virtio: this.devices.saveState(),
    };
  }

  /**
   * Puts a {@link captureDevices} value (unchecked, from a file) into this paused machine, which
   * must be freshly built the same way and not yet run. A malformed or mismatched state is a
   * {@link SnapshotError} naming the field; devices before it may have taken their part, so a
   * machine whose restore failed is stopped, never run. Virtio devices are matched by role (see
   * device-manager.ts); a version 1 state (before roles were saved) is read by place.
   * Every live queue is notified once at resume: a guest may have notified while the snapshotted
   * machine was paused, and a spare notification is harmless.
   */
  restoreDevices(value: unknown, path = 'devices'): void {
    this.requirePausedFor('restore');
    const o = objectAt(value, path);
    const virtio = virtioStatesOf(o, path, DEVICES_STATE_VERSION);
    if ((o.cmos !== undefined) !== (this.rtc !== undefined)) throw new SnapshotError(`${path}.cmos: the state ${o.cmos === undefined ? 'has no' : 'has an'} RTC, this machine ${this.rtc ? 'has one' : 'none'}`);
    this.devices.restoreState(virtio.list, virtio.path);
    this.serial.restoreState(o.serial, `${path}.serial`);
    if (this.rtc) this.rtc.restoreState(o.cmos, `${path}.cmos`);
    for (const tag of this.devices.queueTags()) this.heldNotifies.add(tag);
    this.restoredInterrupts = true;
  }

  private requirePausedFor(what: string): void {
    if (this.ended) throw new VmStateError(`cannot ${what} the state of a stopped machine`);
    if (!this.pausing || this.vcpus.some((v) => v.state === 'running')) throw new VmStateError(`cannot ${what} the state of a running machine: pause it first`);
    if (this.settling.size > 0) throw new VmStateError(`cannot ${what} the state while another capture or restore is under way`);
  }

  private vcpuStateFormat(): VcpuStateFormat {
    this.stateFormat ??= vcpuStateFormat(this.kvm, this.vm, this.linux, this.cpuid);
    return this.stateFormat;
  }

  private settleVcpus(): Promise<void> {
    return Promise.all(this.vcpus.map((v, i) => (v.state === 'created' ? undefined : this.settleVcpu(i, v.state)))).then(() => {});
  }

  /** Enters KVM_RUN with immediate_exit set; {@link onSettleRecord} takes what comes back. */
  private settleVcpu(i: number, resume: VcpuState): Promise<void> {
    return new Promise((resolve, reject) => {
      this.settling.set(i, { resume, resolve, reject });
      this.vcpus[i].state = 'settling';
      this.vcpus[i].fd.run[C.KVM_RUN_IMMEDIATE_EXIT] = 1;
      this.runner.go(i);
    });
  }

  private onSettleRecord(rec: VcpuRecord, s: { resume: VcpuState; resolve: () => void; reject: (e: Error) => void }): void {
    const v = this.vcpus[rec.index];
    this.settling.delete(rec.index);
    if (rec.kind === RecordKind.Interrupted) {
      v.state = s.resume;
      s.resolve();
      return;
    }
    const failed = new SystemCallError('ioctl(KVM_RUN)', rec.err, `vCPU ${rec.index}, finishing its last exit`);
    let error: PvisorError = this.ramLostError(failed) ?? failed;
    if (rec.kind === RecordKind.Exit) {
      // Finishing the instruction made another access (e.g. a string instruction's next element):
      // handled as any exit, then settled again.
      let action: VcpuAction;
      try {
        action = this.handleExit(v);
      } catch (e) {
        action = { kind: 'crash', reason: 'vmm-error', message: `vCPU ${rec.index}: ${(e as Error).message}` };
      }
      if (action.kind !== 'crash') {
        if (action.kind === 'idle') v.seenUsedIndex = action.seenUsedIndex;
        this.settling.set(rec.index, { ...s, resume: action.kind === 'continue' ? 'held' : action.kind === 'idle' ? 'idle' : 'parked' });
        v.fd.run[C.KVM_RUN_IMMEDIATE_EXIT] = 1;
        this.runner.go(rec.index);
        return;
      }
      error = new GuestCrashError(action.reason, action.message);
    }
    s.reject(error);
    this.crash(error);
  }

  private setActivity(i: number, activity: VcpuActivity): void {
    const v = this.vcpus[i];
    if (activity.kind === 'parked') v.state = 'parked';
    else if (activity.kind === 'idle' && activity.seenUsedIndex === this.console.receiveUsedIndex) {
      v.state = 'idle';
      v.seenUsedIndex = activity.seenUsedIndex;
    } else v.state = 'held'; // runnable, or idle with console data it has not seen yet
  }

  /**
   * The guest console's last `count` lines, each quoted and capped: for an error that says where
   * a guest got to (they are the guest's words, which anything in it can print).
   */
  lastConsoleLines(count: number): string[] {
    return this.recentConsole.slice(-count).map(quoteConsole);
  }

  /** Sends bytes to the guest agent (held while paused, so RAM is not written under a strategy). */
  sendToAgent(bytes: Buffer): void {
    if (this.ended) return;
    if (this.pausing) this.console.hold(bytes);
    else this.console.send(bytes);
  }

  /** Tears everything down: threads joined, fds closed, RAM unmapped. Idempotent. */
  stop(): void {
    if (this.ended) return;
    this.ended = true;
    // Nothing more is taken from the guest, not even what a turn left for the next.
    this.tryStep('console hold', () => this.console?.holdTransmit(true));
    // Every step runs whatever an earlier one threw (a leak of threads, fds or guest RAM is worse
    // than a failed step); what failed is said as a warning, stop itself never throws.
    this.tryStep('ending hook', () => this.hooks.onEnding?.());
    this.tryStep('teardown', () => this.release());
    for (const w of this.pauseWaiters.splice(0)) w();
    for (const s of this.settling.values()) s.reject(new VmStateError('the machine stopped while its state was being captured or restored'));
    this.settling.clear();
  }

  private tryStep(what: string, step: () => void): void {
    try {
      step();
    } catch (e) {
      this.hooks.onDeviceError(`while stopping the VM, the ${what} failed: ${(e as Error).message}`);
    }
  }

  get stopped(): boolean {
    return this.ended;
  }

  /** Whether the guest's balloon driver negotiated free page reporting and set up its queue. */
  get freePageReportingActive(): boolean {
    return this.devices.get('balloon')!.reportingActive;
  }

  private release(): void {
    this.releaseGuest();
    this.tryStep('VM fd close', () => this.vm.close());
    this.tryStep('KVM fd close', () => this.kvm.close());
  }

  /**
   * Joins the vCPU threads before anything they use goes away: fds, kvm_run, guest RAM. If the
   * join itself fails, nothing they use is freed (a vCPU thread touching an unmapped kvm_run
   * would crash the process); every later step runs whatever the others do.
   */
  private releaseGuest(): void {
    const step = (what: string, work: () => void) => this.tryStep(what, work);
    // Devices stop before RAM is unmapped (vhost's worker touches it).
    this.devices?.close(step);
    this.runner?.destroy();
    this.devices?.releaseEventFds(step);
    const irqFd = this.serialIrqFd;
    this.serialIrqFd = undefined;
    if (irqFd !== undefined) this.tryStep('eventfd close', () => closeFd(irqFd));
    for (const v of this.vcpus) this.tryStep('vCPU fd close', () => v.fd.close());
    this.vcpus.length = 0;
    this.tryStep('guest RAM unmap', () => this.memory?.unmap());
  }

  private crash(error: PvisorError): void {
    if (this.ended) return;
    // Guest RAM whose backing file was cut under the VM explains whatever the guest did next: a
    // paravirtualised KVM (kvm_pvm) reports a guest touching such a page not as KVM_RUN's EFAULT
    // but as the triple fault the guest then takes, with its IDT and code gone. Read before stop
    // unmaps guest RAM.
    const cause = error instanceof GuestCrashError ? this.ramLostError(error) : undefined;
    this.stop();
    this.hooks.onCrash(cause ?? error);
  }

  /** COM1's edge (ISA line 4), as the virtio devices' lines are raised (see {@link VirtioSignalling}). */
  private serialInterrupt(signalling: VirtioSignalling): () => void {
    if (signalling.interrupt === 'irq-line') {
      return () => {
        this.vm.irqLine(COM1_IRQ, 1);
        this.vm.irqLine(COM1_IRQ, 0);
      };
    }
    const fd = (this.serialIrqFd = createEventFd());
    this.vm.irqfd(fd, COM1_IRQ);
    return () => writeSync(fd, EVENTFD_ONE);
  }

  private checkPaused(): void {
    if (!this.pausing || this.vcpus.some((v) => v.state === 'running')) return;
    for (const w of this.pauseWaiters.splice(0)) w();
  }

  /**
   * The error that ends the VM when guest RAM lost pages under it (see
   * {@link GuestMemory.lostBacking}): a {@link SnapshotError} for a clone mapping its snapshot's
   * RAM file, the only file that backs all of guest RAM; else a {@link GuestCrashError}.
   */
  private ramLostError(cause?: unknown): PvisorError | undefined {
    const why = this.memory.lostBacking();
    if (why === undefined) return undefined;
    return this.memory.backing.kind === 'private-file' ? new SnapshotError(why, { cause }) : new GuestCrashError('backing-lost', why);
  }

  private continueVcpu(i: number): void {
    // A page the host found gone read zero: the guest must not run on it.
    if (this.memory.pagesLost) {
      this.crash(this.ramLostError()!);
      return;
    }
    const v = this.vcpus[i];
    if (this.pausing) {
      v.state = 'held';
      this.checkPaused();
      return;
    }
    v.state = 'running';
    v.fd.run[C.KVM_RUN_IMMEDIATE_EXIT] = 0;
    this.runner.go(i);
  }

  private wakeIdle(): void {
    const used = this.console.receiveUsedIndex;
    for (let i = 0; i < this.vcpus.length; i++) {
      const v = this.vcpus[i];
      if (v.state === 'idle' && v.seenUsedIndex !== used) this.continueVcpu(i);
    }
  }

  private onRecord(rec: VcpuRecord): void {
    if (this.ended || rec.kind === RecordKind.Stopped) return;
    const settling = rec.kind !== RecordKind.Notify ? this.settling.get(rec.index) : undefined;
    if (settling) {
      this.onSettleRecord(rec, settling);
      return;
    }
    try {
      if (rec.kind === RecordKind.Notify) {
        // While paused, guest RAM belongs to the memory strategies: devices wait for resume.
        if (this.pausing) this.heldNotifies.add(rec.index);
        else this.devices.notify(rec.index);
        return;
      }
      let action: VcpuAction;
      if (rec.kind === RecordKind.Exit) action = this.handleExit(this.vcpus[rec.index]);
      else if (rec.kind === RecordKind.Interrupted) action = { kind: 'continue' };
      else {
        const failed = new SystemCallError('ioctl(KVM_RUN)', rec.err, `vCPU ${rec.index}`);
        throw this.ramLostError(failed) ?? failed;
      }
      this.apply(rec.index, action);
    } catch (e) {
      // Whatever the guest did, the host process lives on: the VM ends with the error.
      this.crash(e instanceof PvisorError ? e : new GuestCrashError('vmm-error', `vCPU ${rec.index}: ${(e as Error).message}`));
    }
  }

  private apply(i: number, action: VcpuAction): void {
    const v = this.vcpus[i];
    switch (action.kind) {
      case 'continue':
        this.continueVcpu(i);
        break;
      case 'idle':
        v.seenUsedIndex = action.seenUsedIndex;
        if (this.console.receiveUsedIndex !== action.seenUsedIndex) this.continueVcpu(i);
        else {
          v.state = 'idle';
          this.checkPaused();
        }
        break;
      case 'park':
        v.state = 'parked';
        this.checkPaused();
        break;
      case 'crash':
        this.crash(new GuestCrashError(action.reason, action.message));
        break;
    }
  }

  private handleExit(v: Vcpu): VcpuAction {
    const run = v.fd.run;
    const reason = run.readUInt32LE(C.KVM_RUN_EXIT_REASON);
    switch (reason) {
      case C.KVM_EXIT_IO: {
        const out = run[C.KVM_RUN_IO_DIRECTION] === C.KVM_EXIT_IO_OUT;
        const size = run[C.KVM_RUN_IO_SIZE];
        const port = run.readUInt16LE(C.KVM_RUN_IO_PORT);
        const count = run.readUInt32LE(C.KVM_RUN_IO_COUNT);
        const dataOff = Number(run.readBigUInt64LE(C.KVM_RUN_IO_DATA_OFFSET));
        const dev = this.pio.find(port, size);
        let action: VcpuAction = { kind: 'continue' };
        for (let k = 0; k < count; k++) {
          const at = dataOff + k * size;
          if (out) {
            const r = dev?.device.write(dev.offset, size, run.readUIntLE(at, size));
            if (r) action = r;
          } else {
            // An unclaimed port reads as a floating bus (all ones), as on real hardware.
            run.writeUIntLE(dev ? dev.device.read(dev.offset, size) : 2 ** (8 * size) - 1, at, size);
          }
        }
        return action;
      }
      case C.KVM_EXIT_MMIO: {
        const addr = Number(run.readBigUInt64LE(C.KVM_RUN_MMIO_PHYS_ADDR));
        const len = run.readUInt32LE(C.KVM_RUN_MMIO_LEN);
        const isWrite = run[C.KVM_RUN_MMIO_IS_WRITE] !== 0;
        const dev = len >= 1 && len <= 4 ? this.mmio.find(addr, len) : undefined;
        if (!dev) {
          return { kind: 'crash', reason: 'unhandled-mmio', message: `guest ${isWrite ? 'wrote' : 'read'} ${len} bytes at 0x${addr.toString(16)}, which no device owns` };
        }
        if (isWrite) return dev.device.write(dev.offset, len, run.readUIntLE(C.KVM_RUN_MMIO_DATA, len)) ?? { kind: 'continue' };
        run.writeUIntLE(dev.device.read(dev.offset, len) >>> 0 & (2 ** (8 * len) - 1), C.KVM_RUN_MMIO_DATA, len);
        return { kind: 'continue' };
      }
      case C.KVM_EXIT_SHUTDOWN: {
        if (!this.linux) return { kind: 'crash', reason: 'shutdown', message: 'the guest shut down unexpectedly (a triple fault: an exception it could not handle)' };
        return linuxShutdownCrash(this.recentConsole);
      }
      case C.KVM_EXIT_INTERNAL_ERROR:
        return { kind: 'crash', reason: 'internal-error', message: `KVM internal error, suberror ${run.readUInt32LE(C.KVM_RUN_INTERNAL_SUBERROR)} (e.g. an instruction KVM cannot emulate)` };
      case C.KVM_EXIT_FAIL_ENTRY:
        return { kind: 'crash', reason: 'fail-entry', message: `VM entry failed, hardware reason 0x${run.readBigUInt64LE(C.KVM_RUN_FAIL_ENTRY_REASON).toString(16)}` };
      default:
        return { kind: 'crash', reason: 'unexpected-exit', message: `unexpected KVM exit ${C.KVM_EXIT_NAMES[reason] ?? reason}` };
    }
  }
}

/** Where the VMM had left a paused vCPU, as a saved state says it. */
function activityOf(v: Vcpu): VcpuActivity {
  if (v.state === 'idle') return { kind: 'idle', seenUsedIndex: v.seenUsedIndex };
  if (v.state === 'parked') return { kind: 'parked' };
  return { kind: 'runnable' };
}
