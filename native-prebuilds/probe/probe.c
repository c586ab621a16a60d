/*
 * pvisor probe guest: a freestanding 64-bit program started by the VMM in long mode at CPL3.
 * Specification: docs/probe-guest.md (machine layout, doorbell page, virtio-mmio, agent protocol v1).
 *
 * Constraints: CPL3, no IDT, interrupts off, never a privileged instruction and no port I/O:
 * paravirtualised KVM (kvm_pvm) clears RFLAGS.IOPL, so an `out` at CPL3 is a #GP there (and, with
 * no IDT, a triple fault). Everything the probe tells the VMM directly (console bytes, idle, park,
 * abort) is a 32-bit store to the doorbell page, an unbacked guest-physical page in the MMIO hole
 * whose stores exit to the VMM as MMIO on every KVM. Devices are driven by polling used rings;
 * the probe never takes an interrupt. SSE is only used by the content generators in
 * content.h (the VMM sets CR4.OSFXSR); the rest of the probe is general-registers-only.
 */
#include <stddef.h>
#include <stdint.h>

#include "../include/pv_frame.h"
#include "content.h"
#include "virtio.h"

/* ---------------------------------------------------------------- layout and constants */

#define BOOTINFO_MAGIC   0x50564249u /* "IBVP" */
#define BOOTINFO_VERSION 1u

#define PAGE_SIZE 4096u
#define MIB       (1024u * 1024u)
#define LOW_RAM_END 0xC0000000ull /* start of the 32-bit MMIO hole */

/* The probe's own memory, 0x200000 .. 0x400000 (docs/probe-guest.md, "Probe memory"). */
#define RXQ_MEM    0x200000ull /* console receiveq: desc +0, avail +0x400, used +0x800 */
#define TXQ_MEM    0x201000ull /* console transmitq */
#define BALQ_MEM   0x202000ull /* balloon reporting queue */
#define RXBUF_BASE 0x210000ull /* RXQ_SIZE x 4 KiB receive buffers */
#define TXBUF_BASE 0x220000ull /* TXQ_SIZE x 4 KiB transmit buffers */
#define ACC_BASE   0x240000ull /* frame reassembly buffer */
#define ACC_CAP    0x120000u   /* >= 16 + 1 MiB + RXQ_SIZE * 4 KiB */

#define RXQ_SIZE  16u
#define TXQ_SIZE  16u
#define BALQ_SIZE 32u
#define RXBUF_SIZE 4096u
#define TXBUF_SIZE 4096u
#define REPORT_CHUNK (4u * MIB)

/* The doorbell page (docs/probe-guest.md): 32-bit stores only. */
#define DOORBELL       0xD000F000ull
#define DB_CONSOLE     (DOORBELL + 0x00) /* low byte: a byte of console text */
#define DB_IDLE        (DOORBELL + 0x04) /* park until the console receive used.idx moves */
#define DB_PARK        (DOORBELL + 0x08) /* secondary vCPUs: park until the VM stops */
#define DB_ABORT       (DOORBELL + 0x0C) /* value = abort reason */
#define DB_IGNORED     (DOORBELL + 0x10) /* the VMM only resumes the vCPU (EXIT_STORM) */

/* Abort reason codes (doorbell ABORT). */
#define ABORT_BOOTINFO        1u
#define ABORT_BOOTINFO_VALUES 2u
#define ABORT_CONSOLE_DEVICE  3u
#define ABORT_CONSOLE_FEATURES 4u
#define ABORT_CONSOLE_QUEUE   5u
#define ABORT_BALLOON_DEVICE  6u
#define ABORT_BALLOON_FEATURES 7u
#define ABORT_BALLOON_QUEUE   8u
#define ABORT_VIRTQ_PROTOCOL  9u
#define ABORT_FAULT_REQUESTED 0xFFu

/* Agent protocol v1, in the frames of ../include/pv_frame.h. */
#define OP_HELLO   0x0001
#define OP_PING    0x0002
#define OP_FILL    0x0101
#define OP_REWRITE 0x0102
#define OP_TOUCH   0x0103
#define OP_DIGEST  0x0104
#define OP_RELEASE 0x0105
#define OP_IDLE    0x0106
#define OP_EXIT_STORM 0x0107
#define OP_ZERO    0x0108
#define OP_FAULT   0x01F0
#define OP_HOSTILE 0x01F1

#define ERR_UNSUPPORTED   1u
#define ERR_BAD_ARGUMENT  2u
/* 3 is unused: before the first FILL the working set is empty (0 bytes), not missing. */
#define ERR_NO_REPORTING  4u
#define ERR_BAD_FRAME     5u

#define FAULT_MMIO_ADDR 0xD0100000ull

_Static_assert(ACC_CAP >= PV_FRAME_HDR + PV_FRAME_MAX_PAYLOAD + RXQ_SIZE * RXBUF_SIZE, "ACC_CAP");
_Static_assert(ACC_BASE + ACC_CAP <= 0x400000ull, "probe memory");
_Static_assert(RXBUF_BASE + RXQ_SIZE * RXBUF_SIZE <= TXBUF_BASE, "rx buffers");
_Static_assert(TXBUF_BASE + TXQ_SIZE * TXBUF_SIZE <= ACC_BASE, "tx buffers");

struct bootinfo {
    uint32_t magic;
    uint32_t version;
    uint64_t ram_bytes;
    uint64_t ws_base;
    uint64_t ws_limit;
    uint64_t console_mmio;
    uint64_t balloon_mmio;
    uint32_t vcpu_count;
    uint32_t reserved;
};
_Static_assert(sizeof(struct bootinfo) == 56, "bootinfo");

/* ---------------------------------------------------------------- entry */

/*
 * Entry at 0x100000 (first byte of the image, see probe.ld). All vCPUs may enter with the same
 * RSP, so secondary vCPUs park without touching memory. vCPU 0 zeroes .bss (RAM is zero anyway)
 * and calls probe_main(vcpu, bootinfo) with RSP 16-byte aligned before the call.
 */
__asm__(".section .text.entry,\"ax\",@progbits\n"
        ".globl _start\n"
        "_start:\n"
        "    test %edi, %edi\n"
        "    jnz 2f\n"
        "    mov %rdi, %r8\n"
        "    mov %rsi, %r9\n"
        "    and $-16, %rsp\n"
        "    cld\n"
        "    lea __bss_start(%rip), %rdi\n"
        "    lea __bss_end(%rip), %rcx\n"
        "    sub %rdi, %rcx\n"
        "    xor %eax, %eax\n"
        "    rep stosb\n"
        "    mov %r8, %rdi\n"
        "    mov %r9, %rsi\n"
        "    call probe_main\n"
        "1:  mov $0xD000F00C, %edx\n" /* DB_ABORT */
        "    movl $0xFE, (%rdx)\n"
        "    jmp 1b\n"
        "2:  mov $0xD000F008, %edx\n" /* DB_PARK */
        "3:  mov %edi, (%rdx)\n"
        "    pause\n"
        "    jmp 3b\n"
        ".previous\n");

/* ---------------------------------------------------------------- freestanding libc bits */

void *memcpy(void *dst, const void *src, size_t n)
{
    void *d = dst;
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(n) : : "memory");
    return dst;
}

void *memmove(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d <= s || d >= s + n)
        return memcpy(dst, src, n);
    while (n) {
        n--;
        d[n] = s[n];
    }
    return dst;
}

void *memset(void *dst, int c, size_t n)
{
    void *d = dst;
    __asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
    return dst;
}

int memcmp(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return x[i] < y[i] ? -1 : 1;
    return 0;
}

static size_t str_len(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

/* ---------------------------------------------------------------- CPU helpers */

#define barrier() __atomic_signal_fence(__ATOMIC_SEQ_CST)

static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }

static inline uint64_t rdtsc(void)
{
    uint32_t lo, hi;
    __asm__ volatile("lfence\n\trdtsc" : "=a"(lo), "=d"(hi) : : "memory");
    return ((uint64_t)hi << 32) | lo;
}

/* MMIO: always a single 32-bit mov, so the VMM's instruction decoding is trivial. */
static inline uint32_t mmio_read32(uint64_t addr)
{
    uint32_t v;
    __asm__ volatile("movl (%1), %0" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

static inline void mmio_write32(uint64_t addr, uint32_t v)
{
    __asm__ volatile("movl %0, (%1)" : : "r"(v), "r"(addr) : "memory");
}

static inline uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
    return v;
}

static inline void wr32(uint8_t *p, uint32_t v) { __builtin_memcpy(p, &v, 4); }
static inline void wr64(uint8_t *p, uint64_t v) { __builtin_memcpy(p, &v, 8); }

/* ---------------------------------------------------------------- debug console and abort */

static void log_str(const char *s)
{
    while (*s)
        mmio_write32(DB_CONSOLE, (uint8_t)*s++);
}

static void log_hex(uint64_t v)
{
    static const char digits[] = "0123456789abcdef";
    char buf[19];
    int n = 0;
    buf[n++] = '0';
    buf[n++] = 'x';
    int shift = 60;
    while (shift > 0 && ((v >> shift) & 0xF) == 0)
        shift -= 4;
    for (; shift >= 0; shift -= 4)
        buf[n++] = digits[(v >> shift) & 0xF];
    buf[n] = 0;
    log_str(buf);
}

__attribute__((noreturn)) static void guest_abort(uint32_t reason, const char *why)
{
    log_str("probe: abort ");
    log_hex(reason);
    log_str(": ");
    log_str(why);
    log_str("\n");
    for (;;)
        mmio_write32(DB_ABORT, reason);
}

/* ---------------------------------------------------------------- virtio */

struct vq {
    uint64_t mmio;
    uint32_t index;
    uint32_t size;
    volatile struct virtq_desc *desc;
    volatile struct virtq_avail *avail;
    volatile struct virtq_used *used;
    uint16_t avail_idx; /* next avail.idx to publish */
    uint16_t last_used; /* used.idx consumed so far */
};

static inline uint16_t vq_used_idx(const struct vq *q)
{
    uint16_t v = q->used->idx; /* volatile 16-bit load */
    barrier();
    return v;
}

/* Queue descriptor head into the avail ring (not yet published). */
static inline void vq_push(struct vq *q, uint16_t head)
{
    q->avail->ring[q->avail_idx % q->size] = head;
    q->avail_idx++;
}

/* Publish avail.idx, then notify unless the device asked not to be notified. */
static void vq_kick(struct vq *q)
{
    barrier(); /* descriptors and ring entries before idx (x86 keeps stores in order) */
    q->avail->idx = q->avail_idx;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* idx store before reading used.flags */
    if (!(q->used->flags & VIRTQ_USED_F_NO_NOTIFY))
        mmio_write32(q->mmio + VIRTIO_MMIO_QUEUE_NOTIFY, q->index);
}

static inline void vdev_set_status(uint64_t mmio, uint32_t bits)
{
    mmio_write32(mmio + VIRTIO_MMIO_STATUS, mmio_read32(mmio + VIRTIO_MMIO_STATUS) | bits);
}

/* DRIVER_OK; a device that rejected the queue setup answers with DEVICE_NEEDS_RESET. */
static void vdev_driver_ok(uint64_t mmio, uint32_t reason, const char *name)
{
    vdev_set_status(mmio, VIRTIO_STATUS_DRIVER_OK);
    uint32_t status = mmio_read32(mmio + VIRTIO_MMIO_STATUS);
    if ((status & VIRTIO_STATUS_NEEDS_RESET) || !(status & VIRTIO_STATUS_DRIVER_OK))
        guest_abort(reason, name);
}

/*
 * Reset, ACKNOWLEDGE, DRIVER, feature negotiation and FEATURES_OK (virtio 3.1.1).
 * Returns the negotiated features; aborts with feature_reason if VERSION_1 is not offered or
 * FEATURES_OK does not stick.
 */
static uint64_t vdev_begin(uint64_t mmio, uint32_t device_id, uint64_t wanted,
                           uint32_t device_reason, uint32_t feature_reason, const char *name)
{
    if (mmio_read32(mmio + VIRTIO_MMIO_MAGIC_VALUE) != VIRTIO_MMIO_MAGIC ||
        mmio_read32(mmio + VIRTIO_MMIO_VERSION) != 2 ||
        mmio_read32(mmio + VIRTIO_MMIO_DEVICE_ID) != device_id)
        guest_abort(device_reason, name);

    mmio_write32(mmio + VIRTIO_MMIO_STATUS, 0);
    while (mmio_read32(mmio + VIRTIO_MMIO_STATUS) != 0)
        cpu_relax();
    vdev_set_status(mmio, VIRTIO_STATUS_ACKNOWLEDGE);
    vdev_set_status(mmio, VIRTIO_STATUS_DRIVER);

    mmio_write32(mmio + VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    uint64_t lo = mmio_read32(mmio + VIRTIO_MMIO_DEVICE_FEATURES);
    mmio_write32(mmio + VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
    uint64_t hi = mmio_read32(mmio + VIRTIO_MMIO_DEVICE_FEATURES);
    uint64_t offered = lo | (hi << 32);
    if (!(offered & (1ull << VIRTIO_F_VERSION_1))) {
        vdev_set_status(mmio, VIRTIO_STATUS_FAILED);
        guest_abort(feature_reason, name);
    }
    uint64_t features = offered & wanted;
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)features);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
    mmio_write32(mmio + VIRTIO_MMIO_DRIVER_FEATURES, (uint32_t)(features >> 32));

    vdev_set_status(mmio, VIRTIO_STATUS_FEATURES_OK);
    if (!(mmio_read32(mmio + VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_FEATURES_OK)) {
        vdev_set_status(mmio, VIRTIO_STATUS_FAILED);
        guest_abort(feature_reason, name);
    }
    return features;
}

/* The selected queue's size and ring addresses. */
static void vq_write_regs(uint64_t mmio, uint32_t num, uint64_t desc, uint64_t drv, uint64_t dev)
{
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_NUM, num);
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DESC_LOW, (uint32_t)desc);
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DESC_HIGH, (uint32_t)(desc >> 32));
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DRIVER_LOW, (uint32_t)drv);
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DRIVER_HIGH, (uint32_t)(drv >> 32));
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DEVICE_LOW, (uint32_t)dev);
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_DEVICE_HIGH, (uint32_t)(dev >> 32));
}

/*
 * Zeroes `bytes` of rings at `mem` (descriptors at +0, avail at +avail_off, used at +used_off),
 * describes them in `q` and hands them to the device as the selected queue `index`, ready.
 */
static void vq_place(struct vq *q, uint64_t mmio, uint32_t index, uint32_t size, uint64_t mem,
                     uint64_t avail_off, uint64_t used_off, uint64_t bytes)
{
    memset((void *)mem, 0, bytes);
    q->mmio = mmio;
    q->index = index;
    q->size = size;
    q->desc = (volatile struct virtq_desc *)mem;
    q->avail = (volatile struct virtq_avail *)(mem + avail_off);
    q->used = (volatile struct virtq_used *)(mem + used_off);
    q->avail_idx = 0;
    q->last_used = 0;
    q->avail->flags = VIRTQ_AVAIL_F_NO_INTERRUPT; /* we poll */
    vq_write_regs(mmio, size, mem, mem + avail_off, mem + used_off);
    barrier();
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_READY, 1);
}

/* Configure queue `index` with a power-of-two size <= min(want, QueueNumMax). */
static void vq_setup(struct vq *q, uint64_t mmio, uint32_t index, uint32_t want, uint64_t mem,
                     uint32_t reason, const char *name)
{
    mmio_write32(mmio + VIRTIO_MMIO_QUEUE_SEL, index);
    if (mmio_read32(mmio + VIRTIO_MMIO_QUEUE_READY) != 0) {
        vdev_set_status(mmio, VIRTIO_STATUS_FAILED);
        guest_abort(reason, name);
    }
    uint32_t max = mmio_read32(mmio + VIRTIO_MMIO_QUEUE_NUM_MAX);
    uint32_t size = want;
    while (size > max)
        size >>= 1;
    if (size == 0) {
        vdev_set_status(mmio, VIRTIO_STATUS_FAILED);
        guest_abort(reason, name);
    }
    vq_place(q, mmio, index, size, mem, 0x400, 0x800, 0x1000);
}

/* ---------------------------------------------------------------- state */

static struct {
    uint64_t ram_bytes;
    uint64_t ws_base;
    uint64_t ws_limit; /* effective, exclusive */
    uint64_t ws_bytes; /* current working set: 0 (empty) until the first FILL */
    uint32_t ws_kind;
    int reporting; /* balloon negotiated FREE_PAGE_REPORTING */
    uint32_t acc_len; /* bytes buffered in the reassembly buffer */
} st;

static struct vq rxq, txq, balq;
static uint8_t tx_busy[TXQ_SIZE];

static volatile uint32_t touch_sink;

#define ACC ((uint8_t *)ACC_BASE)

/* ---------------------------------------------------------------- transmit */

static void tx_reclaim(void)
{
    uint16_t u = vq_used_idx(&txq);
    while (txq.last_used != u) {
        uint32_t id = txq.used->ring[txq.last_used % txq.size].id;
        if (id >= txq.size)
            guest_abort(ABORT_VIRTQ_PROTOCOL, "console transmitq: bad used id");
        tx_busy[id] = 0;
        txq.last_used++;
    }
}

static uint32_t tx_slot(void)
{
    for (;;) {
        tx_reclaim();
        for (uint32_t i = 0; i < txq.size; i++)
            if (!tx_busy[i])
                return i;
        cpu_relax();
    }
}

static void tx_drain(void)
{
    for (;;) {
        tx_reclaim();
        if (txq.last_used == txq.avail_idx)
            return;
        cpu_relax();
    }
}

static void tx_post(uint32_t slot, uint64_t addr, uint32_t len)
{
    volatile struct virtq_desc *d = &txq.desc[slot];
    d->addr = addr;
    d->len = len;
    d->flags = 0;
    d->next = 0;
    tx_busy[slot] = 1;
    vq_push(&txq, (uint16_t)slot);
    vq_kick(&txq);
}

/* Send one frame (header + up to TXBUF_SIZE-16 payload bytes) as one descriptor. */
static void send_frame(uint8_t type, uint32_t id, uint16_t op, const void *payload, uint32_t len)
{
    uint32_t slot = tx_slot();
    uint8_t *buf = (uint8_t *)(TXBUF_BASE + (uint64_t)slot * TXBUF_SIZE);
    pv_frame_header_put(buf, type, id, op, 0, len);
    if (len)
        memcpy(buf + PV_FRAME_HDR, payload, len);
    tx_post(slot, (uint64_t)buf, PV_FRAME_HDR + len);
}

/*
 * Send a frame that is larger than a tx buffer from where it lies (header immediately before
 * the payload), as one descriptor, and wait until the device has consumed it.
 */
static void send_frame_inplace(uint8_t *frame, uint8_t type, uint32_t id, uint16_t op, uint32_t len)
{
    tx_drain();
    pv_frame_header_put(frame, type, id, op, 0, len);
    uint32_t slot = tx_slot();
    tx_post(slot, (uint64_t)frame, PV_FRAME_HDR + len);
    tx_drain();
}

static void respond(uint32_t id, uint16_t op, const void *payload, uint32_t len)
{
    send_frame(PV_T_RESPONSE, id, op, payload, len);
}

/* The answer of the timed ops: a count and the TSC cycles the work took. */
static void respond_counted(uint32_t id, uint16_t op, uint64_t count, uint64_t cycles)
{
    uint8_t out[16];
    wr64(out, count);
    wr64(out + 8, cycles);
    respond(id, op, out, sizeof(out));
}

static void respond_error(uint32_t id, uint16_t op, uint32_t code, const char *text)
{
    uint8_t buf[128];
    uint32_t n = (uint32_t)str_len(text);
    if (n > sizeof(buf) - 4)
        n = sizeof(buf) - 4;
    wr32(buf, code);
    memcpy(buf + 4, text, n);
    send_frame(PV_T_ERROR, id, op, buf, 4 + n);
}

/* ---------------------------------------------------------------- balloon free page reporting */

static uint64_t balloon_report(uint64_t gpa, uint64_t len)
{
    uint64_t reported = 0;
    while (len) {
        uint32_t n = 0;
        while (len && n < balq.size) {
            uint64_t room = REPORT_CHUNK - (gpa & (REPORT_CHUNK - 1));
            uint64_t chunk = len < room ? len : room;
            volatile struct virtq_desc *d = &balq.desc[n];
            d->addr = gpa;
            d->len = (uint32_t)chunk;
            d->flags = VIRTQ_DESC_F_WRITE;
            d->next = 0;
            vq_push(&balq, (uint16_t)n);
            n++;
            gpa += chunk;
            len -= chunk;
            reported += chunk;
        }
        vq_kick(&balq);
        for (;;) {
            uint16_t u = vq_used_idx(&balq);
            if (u == balq.avail_idx)
                break;
            cpu_relax();
        }
        balq.last_used = balq.avail_idx;
    }
    return reported;
}

/* ---------------------------------------------------------------- ops */

static void op_fill(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 16) {
        respond_error(id, OP_FILL, ERR_BAD_ARGUMENT, "FILL: payload too short");
        return;
    }
    uint64_t size = rd64(p);
    uint32_t kind = rd32(p + 8), seed = rd32(p + 12);
    if (size % PAGE_SIZE) {
        respond_error(id, OP_FILL, ERR_BAD_ARGUMENT, "FILL: size not a multiple of 4 KiB");
        return;
    }
    if (size > st.ws_limit - st.ws_base) {
        respond_error(id, OP_FILL, ERR_BAD_ARGUMENT, "FILL: size beyond wsLimit");
        return;
    }
    if (kind >= CONTENT_KIND_COUNT) {
        respond_error(id, OP_FILL, ERR_BAD_ARGUMENT, "FILL: bad content kind");
        return;
    }
    uint64_t t0 = rdtsc();
    content_fill((uint32_t *)st.ws_base, 0, size / PAGE_SIZE, kind, seed);
    uint64_t t1 = rdtsc();
    st.ws_bytes = size;
    st.ws_kind = kind;
    respond_counted(id, OP_FILL, size, t1 - t0);
}

static void op_rewrite(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 8) {
        respond_error(id, OP_REWRITE, ERR_BAD_ARGUMENT, "REWRITE: payload too short");
        return;
    }
    uint32_t permille = rd32(p), seed = rd32(p + 4);
    if (permille > 1000) {
        respond_error(id, OP_REWRITE, ERR_BAD_ARGUMENT, "REWRITE: permille > 1000");
        return;
    }
    uint64_t t0 = rdtsc();
    uint64_t n = content_rewrite((uint32_t *)st.ws_base, st.ws_bytes / PAGE_SIZE, st.ws_kind,
                                 permille, seed);
    uint64_t t1 = rdtsc();
    respond_counted(id, OP_REWRITE, n, t1 - t0);
}

static void op_zero(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 16) {
        respond_error(id, OP_ZERO, ERR_BAD_ARGUMENT, "ZERO: payload too short");
        return;
    }
    uint64_t off = rd64(p), n = rd64(p + 8);
    if ((off | n) % PAGE_SIZE) {
        respond_error(id, OP_ZERO, ERR_BAD_ARGUMENT, "ZERO: offset or length not a multiple of 4 KiB");
        return;
    }
    if (off > st.ws_bytes || n > st.ws_bytes - off) {
        respond_error(id, OP_ZERO, ERR_BAD_ARGUMENT, "ZERO: range beyond the working set");
        return;
    }
    uint64_t t0 = rdtsc();
    memset((void *)(st.ws_base + off), 0, n);
    uint64_t t1 = rdtsc();
    respond_counted(id, OP_ZERO, n, t1 - t0);
}

static void op_touch(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 12) {
        respond_error(id, OP_TOUCH, ERR_BAD_ARGUMENT, "TOUCH: payload too short");
        return;
    }
    uint64_t hot = rd64(p);
    uint32_t rounds = rd32(p + 8);
    if (hot % PAGE_SIZE) {
        respond_error(id, OP_TOUCH, ERR_BAD_ARGUMENT, "TOUCH: hotBytes not a multiple of 4 KiB");
        return;
    }
    if (hot > st.ws_bytes) {
        respond_error(id, OP_TOUCH, ERR_BAD_ARGUMENT, "TOUCH: hotBytes beyond the working set");
        return;
    }
    uint64_t pages = hot / PAGE_SIZE;
    uint32_t sum = 0;
    uint64_t t0 = rdtsc();
    for (uint32_t r = 0; r < rounds; r++)
        for (uint64_t i = 0; i < pages; i++)
            sum += *(volatile const uint32_t *)(st.ws_base + i * PAGE_SIZE);
    uint64_t t1 = rdtsc();
    touch_sink = sum;
    respond_counted(id, OP_TOUCH, pages * rounds, t1 - t0);
}

static void op_digest(uint32_t id)
{
    uint32_t h1, h2;
    uint64_t t0 = rdtsc();
    content_digest((const uint32_t *)st.ws_base, st.ws_bytes, &h1, &h2);
    uint64_t t1 = rdtsc();
    uint8_t out[24];
    wr64(out, st.ws_bytes);
    wr32(out + 8, h1);
    wr32(out + 12, h2);
    wr64(out + 16, t1 - t0);
    respond(id, OP_DIGEST, out, sizeof(out));
}

static void op_release(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 16) {
        respond_error(id, OP_RELEASE, ERR_BAD_ARGUMENT, "RELEASE: payload too short");
        return;
    }
    uint64_t off = rd64(p), length = rd64(p + 8);
    uint64_t area = st.ws_limit - st.ws_base;
    if ((off | length) % PAGE_SIZE) {
        respond_error(id, OP_RELEASE, ERR_BAD_ARGUMENT, "RELEASE: range not 4 KiB aligned");
        return;
    }
    if (off > area || length > area - off) {
        respond_error(id, OP_RELEASE, ERR_BAD_ARGUMENT, "RELEASE: range beyond wsLimit");
        return;
    }
    if (!st.reporting) {
        respond_error(id, OP_RELEASE, ERR_NO_REPORTING,
                      "RELEASE: balloon has no free page reporting");
        return;
    }
    uint64_t n = balloon_report(st.ws_base + off, length);
    uint8_t out[8];
    wr64(out, n);
    respond(id, OP_RELEASE, out, sizeof(out));
}

static void op_exit_storm(uint32_t id, const uint8_t *p, uint32_t len)
{
    if (len < 4) {
        respond_error(id, OP_EXIT_STORM, ERR_BAD_ARGUMENT, "EXIT_STORM: payload too short");
        return;
    }
    uint32_t count = rd32(p);
    uint64_t t0 = rdtsc();
    for (uint32_t i = 0; i < count; i++)
        mmio_write32(DB_IGNORED, i);
    uint64_t t1 = rdtsc();
    respond_counted(id, OP_EXIT_STORM, count, t1 - t0);
}

static void op_fault(uint32_t id, const uint8_t *p, uint32_t len)
{
    uint32_t kind = len >= 4 ? rd32(p) : 0;
    switch (kind) {
    case 1:
        log_str("probe: FAULT 1: ud2 without IDT\n");
        __asm__ volatile("ud2");
        __builtin_unreachable();
    case 2:
        log_str("probe: FAULT 2: read of unowned MMIO\n");
        (void)mmio_read32(FAULT_MMIO_ADDR);
        return; /* never answers; keeps serving if the VMM resumes us */
    case 3:
        guest_abort(ABORT_FAULT_REQUESTED, "FAULT 3 requested");
    default:
        respond_error(id, OP_FAULT, ERR_BAD_ARGUMENT, "FAULT: unknown kind");
    }
}

#include "hostile.h"

/* Dispatch one complete frame `h`, lying at `frame` in the reassembly buffer. */
static void dispatch(uint8_t *frame, struct pv_frame h)
{
    const uint8_t *p = h.payload;
    if (h.type != PV_T_REQUEST) {
        respond_error(h.id, h.op, ERR_BAD_FRAME, "frame is not a request");
        return;
    }
    switch (h.op) {
    case OP_PING:
        if (h.len <= TXBUF_SIZE - PV_FRAME_HDR)
            respond(h.id, OP_PING, p, h.len);
        else
            send_frame_inplace(frame, PV_T_RESPONSE, h.id, OP_PING, h.len);
        break;
    case OP_FILL:
        op_fill(h.id, p, h.len);
        break;
    case OP_REWRITE:
        op_rewrite(h.id, p, h.len);
        break;
    case OP_TOUCH:
        op_touch(h.id, p, h.len);
        break;
    case OP_DIGEST:
        op_digest(h.id);
        break;
    case OP_RELEASE:
        op_release(h.id, p, h.len);
        break;
    case OP_IDLE:
        respond(h.id, OP_IDLE, 0, 0); /* the main loop parks when there is nothing to do */
        break;
    case OP_EXIT_STORM:
        op_exit_storm(h.id, p, h.len);
        break;
    case OP_ZERO:
        op_zero(h.id, p, h.len);
        break;
    case OP_FAULT:
        op_fault(h.id, p, h.len);
        break;
    case OP_HOSTILE:
        op_hostile(h.id, p, h.len);
        break;
    default:
        respond_error(h.id, h.op, ERR_UNSUPPORTED, "unsupported op");
        break;
    }
}

/* Dispatch every complete frame in the reassembly buffer; keep the incomplete tail. */
static void process_frames(void)
{
    uint32_t pos = 0;
    for (;;) {
        /* st.acc_len is read anew each time: HOSTILE may take more bytes in while it runs. */
        struct pv_frame f;
        enum pv_scan r = pv_frame_scan(ACC + pos, st.acc_len - pos, &f, 0);
        if (r == PV_NEED_MORE)
            break;
        if (r == PV_BAD) {
            /* Lost framing: report it and resynchronise by dropping everything buffered. */
            respond_error(0, 0, ERR_BAD_FRAME, "bad frame header (magic/version/length)");
            st.acc_len = 0;
            return;
        }
        dispatch(ACC + pos, f);
        pos += PV_FRAME_HDR + f.len;
    }
    if (pos) {
        memmove(ACC, ACC + pos, st.acc_len - pos);
        st.acc_len -= pos;
    }
}

/*
 * Move every used receive buffer into the reassembly buffer and, if `repost`, post it again
 * (HOSTILE takes the last ones of a queue it is about to reset without re-posting them).
 */
static int rx_take_used(int repost)
{
    uint16_t u = vq_used_idx(&rxq);
    if (u == rxq.last_used)
        return 0;
    while (rxq.last_used != u) {
        volatile struct virtq_used_elem *e = &rxq.used->ring[rxq.last_used % rxq.size];
        uint32_t id = e->id, len = e->len;
        if (id >= rxq.size || len > RXBUF_SIZE)
            guest_abort(ABORT_VIRTQ_PROTOCOL, "console receiveq: bad used element");
        if (st.acc_len + len > ACC_CAP)
            guest_abort(ABORT_VIRTQ_PROTOCOL, "console receiveq: reassembly overflow");
        memcpy(ACC + st.acc_len, (const void *)(RXBUF_BASE + (uint64_t)id * RXBUF_SIZE), len);
        st.acc_len += len;
        if (repost)
            vq_push(&rxq, (uint16_t)id); /* the descriptor still describes buffer id */
        rxq.last_used++;
    }
    if (repost)
        vq_kick(&rxq);
    return 1;
}

static int rx_collect(void)
{
    return rx_take_used(1);
}

/* ---------------------------------------------------------------- boot */

static void setup_console(uint64_t mmio)
{
    vdev_begin(mmio, VIRTIO_ID_CONSOLE, 1ull << VIRTIO_F_VERSION_1, ABORT_CONSOLE_DEVICE,
               ABORT_CONSOLE_FEATURES, "virtio-console");
    vq_setup(&rxq, mmio, 0, RXQ_SIZE, RXQ_MEM, ABORT_CONSOLE_QUEUE, "console receiveq");
    vq_setup(&txq, mmio, 1, TXQ_SIZE, TXQ_MEM, ABORT_CONSOLE_QUEUE, "console transmitq");
    vdev_driver_ok(mmio, ABORT_CONSOLE_QUEUE, "virtio-console: DRIVER_OK refused");
}

static void setup_balloon(uint64_t mmio)
{
    uint64_t f = vdev_begin(mmio, VIRTIO_ID_BALLOON,
                            (1ull << VIRTIO_F_VERSION_1) | (1ull << VIRTIO_BALLOON_F_REPORTING),
                            ABORT_BALLOON_DEVICE, ABORT_BALLOON_FEATURES, "virtio-balloon");
    st.reporting = (f >> VIRTIO_BALLOON_F_REPORTING) & 1;
    if (st.reporting)
        vq_setup(&balq, mmio, VIRTIO_BALLOON_REPORTING_QUEUE, BALQ_SIZE, BALQ_MEM,
                 ABORT_BALLOON_QUEUE, "balloon reporting queue");
    vdev_driver_ok(mmio, ABORT_BALLOON_QUEUE, "virtio-balloon: DRIVER_OK refused");
}

static void post_rx_buffers(void)
{
    for (uint32_t i = 0; i < rxq.size; i++) {
        volatile struct virtq_desc *d = &rxq.desc[i];
        d->addr = RXBUF_BASE + (uint64_t)i * RXBUF_SIZE;
        d->len = RXBUF_SIZE;
        d->flags = VIRTQ_DESC_F_WRITE;
        d->next = 0;
        vq_push(&rxq, (uint16_t)i);
    }
    vq_kick(&rxq);
}

static void send_hello(void)
{
    uint8_t out[32];
    wr32(out, 1);     /* protocolVersion */
    wr32(out + 4, 1); /* guestKind: probe */
    wr64(out + 8, st.ram_bytes);
    wr64(out + 16, st.ws_base);
    wr64(out + 24, st.ws_limit);
    send_frame(PV_T_EVENT, 0, OP_HELLO, out, sizeof(out));
}

__attribute__((noreturn, used)) void probe_main(uint64_t vcpu, uint64_t bootinfo_gpa)
{
    (void)vcpu; /* secondary vCPUs never get here (see _start) */
    const volatile struct bootinfo *bi = (const volatile struct bootinfo *)bootinfo_gpa;
    if (bi->magic != BOOTINFO_MAGIC || bi->version != BOOTINFO_VERSION)
        guest_abort(ABORT_BOOTINFO, "bad boot info magic/version");
    log_str("pvisor probe v1\n");

    st.ram_bytes = bi->ram_bytes;
    st.ws_base = bi->ws_base;
    uint64_t low_end = st.ram_bytes < LOW_RAM_END ? st.ram_bytes : LOW_RAM_END;
    uint64_t lim = bi->ws_limit < low_end ? bi->ws_limit : low_end;
    lim &= ~(uint64_t)(PAGE_SIZE - 1);
    if (st.ws_base < 0x400000ull || (st.ws_base & (PAGE_SIZE - 1)) || bi->ws_limit < st.ws_base ||
        lim < st.ws_base || bi->console_mmio == 0)
        guest_abort(ABORT_BOOTINFO_VALUES, "bad boot info values");
    st.ws_limit = lim;
    uint64_t console = bi->console_mmio, balloon = bi->balloon_mmio;
    h_console_mmio = console;
    h_balloon_mmio = balloon;

    content_init();
    setup_console(console);
    if (balloon)
        setup_balloon(balloon);
    post_rx_buffers();
    send_hello();
    log_str("probe: ready\n");

    for (;;) {
        if (rx_collect()) {
            process_frames();
            continue;
        }
        /* Nothing to do: park until the receive queue's used.idx moves past what we saw. */
        mmio_write32(DB_IDLE, rxq.last_used);
    }
}
