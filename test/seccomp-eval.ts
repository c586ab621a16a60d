// Runs a classic-BPF seccomp program on one call as the kernel does (struct seccomp_data: nr,
// arch, instruction pointer, six arguments) and counts the instructions it executes: what the
// filter decides for that call, and its exact cost, on any host (no root, no seccomp). Knows the
// instructions libseccomp emits; anything else throws. Used by test/unit/jail.test.ts and
// scripts/measure-filter-cost.js.

/** x86-64's audit architecture (AUDIT_ARCH_X86_64), which a libseccomp program checks first. */
export const AUDIT_ARCH_X86_64 = 0xc000003e;
/** i386's (AUDIT_ARCH_I386): a 32-bit call, which an x86-64 filter must not judge by x86-64 numbers. */
export const AUDIT_ARCH_I386 = 0x40000003;
/** SECCOMP_RET_ALLOW and SECCOMP_RET_KILL_PROCESS. */
export const RET_ALLOW = 0x7fff0000;
export const RET_KILL_PROCESS = 0x80000000;

/** The program's verdict on one call, and how many instructions it took. */
export interface SeccompVerdict {
  action: number;
  executed: number;
}

export function evaluateSeccomp(program: Buffer, nr: number, args: readonly number[] = [], arch = AUDIT_ARCH_X86_64): SeccompVerdict {
  const data = Buffer.alloc(64);
  data.writeUInt32LE(nr, 0);
  data.writeUInt32LE(arch, 4);
  args.forEach((a, i) => data.writeBigUInt64LE(BigInt(a), 16 + 8 * i));
  const mem = new Uint32Array(16);
  let A = 0;
  let X = 0;
  let pc = 0;
  let executed = 0;
  for (;;) {
    if (pc * 8 + 8 > program.length) throw new Error(`the program ran off its end at ${pc}`);
    const at = pc * 8;
    const code = program.readUInt16LE(at);
    const jt = program[at + 2];
    const jf = program[at + 3];
    const k = program.readUInt32LE(at + 4);
    executed++;
    pc++;
    const src = code & 0x08 ? X : k;
    const op = code & 0xf0;
    switch (code & 0x07) {
      case 0x00: // BPF_LD: W|ABS from seccomp_data, IMM, MEM
        if ((code & 0xe0) === 0x20 && (code & 0x18) === 0) A = data.readUInt32LE(k);
        else if ((code & 0xe0) === 0x00) A = k;
        else if ((code & 0xe0) === 0x60) A = mem[k];
        else throw new Error(`unknown load 0x${code.toString(16)}`);
        break;
      case 0x01: // BPF_LDX
        X = (code & 0xe0) === 0x60 ? mem[k] : k;
        break;
      case 0x02: // BPF_ST
        mem[k] = A;
        break;
      case 0x03: // BPF_STX
        mem[k] = X;
        break;
      case 0x04: // BPF_ALU
        if (op === 0x50) A = (A & src) >>> 0;
        else if (op === 0x40) A = (A | src) >>> 0;
        else if (op === 0x00) A = (A + src) >>> 0;
        else if (op === 0x10) A = (A - src) >>> 0;
        else if (op === 0xa0) A = (A ^ src) >>> 0;
        else if (op === 0x60) A = (A << src) >>> 0;
        else if (op === 0x70) A = A >>> src;
        else throw new Error(`unknown ALU op 0x${code.toString(16)}`);
        break;
      case 0x05: {
        // BPF_JMP
        if (op === 0x00) {
          pc += k;
          break;
        }
        const taken = op === 0x10 ? A === src : op === 0x20 ? A > src : op === 0x30 ? A >= src : op === 0x40 ? (A & src) !== 0 : undefined;
        if (taken === undefined) throw new Error(`unknown jump 0x${code.toString(16)}`);
        pc += taken ? jt : jf;
        break;
      }
      case 0x06: // BPF_RET: K or A
        return { action: (code & 0x10 ? A : k) >>> 0, executed };
      default: // BPF_MISC: TAX, TXA
        if (code & 0x80) A = X;
        else X = A;
    }
  }
}
