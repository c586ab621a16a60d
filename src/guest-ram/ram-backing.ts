/**
 * How guest RAM is backed, and what each backing can do. The memory layer picks one backing per
 * VM before the machine exists (at most one strategy of a composition asks for one; the default is
 * private anonymous memory), checks every strategy's needs against what it offers, and opens it.
 */
import { fstatSync, ftruncateSync, openSync } from 'node:fs';
import { BackingFileError } from '../errors';
import { MFD_CLOEXEC } from '../sys/constants';
import { closeFd, createMemfd, dupFd } from '../sys/libc';

/**
 * Something a strategy relies on guest RAM's backing to do.
 * @category Strategies
 */
export type RamCapability =
  /** A page can be made to read back as zero by discarding it (see {@link DiscardTo}). */
  | 'zero-on-discard'
  /** The kernel's KSM can merge its pages (private anonymous pages, or the private copies of a file's). */
  | 'ksm-mergeable'
  /** Missing pages can be served through userfaultfd's missing mode (anonymous memory, memfds). */
  | 'userfaultfd-missing'
  /**
   * Pages can be write-protected through userfaultfd and dropped so that the next touch is a
   * missing-page fault: private anonymous memory (a memfd's dropped page stays in its file).
   */
  | 'userfaultfd-write-protect';

/**
 * A backing a strategy asks for; the memory layer creates or opens it.
 * @category Strategies
 */
export type RamBackingRequest =
  /** Private anonymous memory, allocated on first touch: the default. */
  | { kind: 'anonymous' }
  /** A memfd that only this VM maps, shared: its pages are the file's, so another mapping or process can see them. */
  | { kind: 'memfd' }
  /**
   * A file mapped MAP_PRIVATE: pages the guest only reads are the file's page cache, shared with
   * every other mapping of it; a write makes a private copy. Opened read-only; it must be at least
   * as large as guest RAM (beyond its end the guest would fault). With `fd`, that descriptor of
   * it is duplicated instead of opening `path` again (the caller keeps and closes its own).
   */
  | { kind: 'private-file'; path: string; fd?: number };

/**
 * The kinds of backing.
 * @category Strategies
 */
export type RamBackingKind = RamBackingRequest['kind'];

/** A backing the memory layer has opened, as guest memory maps it; it owns the fd from then on. */
export type RamBacking = { kind: 'anonymous' } | { kind: 'memfd'; fd: number } | { kind: 'private-file'; fd: number; path: string };

/**
 * What a discard makes a page read back as. On anonymous memory and memfds both are the same
 * (zero). On a MAP_PRIVATE file, `backing` drops the private copy so the page is the file's again
 * (what a strategy wants for a page it will restore anyway, or for a page the guest freed), while
 * `zero` maps anonymous memory over it (what a page the guest zeroed must read as).
 * @category Strategies
 */
export type DiscardTo = 'zero' | 'backing';

/** What each backing offers. */
export const BACKING_CAPABILITIES: Readonly<Record<RamBackingKind, readonly RamCapability[]>> = {
  anonymous: ['zero-on-discard', 'ksm-mergeable', 'userfaultfd-missing', 'userfaultfd-write-protect'],
  // KSM leaves shared mappings alone; shmem supports userfaultfd's missing mode; a punched hole reads zero.
  memfd: ['zero-on-discard', 'userfaultfd-missing'],
  // Zero through an anonymous page mapped over the range; userfaultfd's missing mode is only
  // offered for anonymous, shmem and hugetlbfs mappings, not for a private mapping of a file.
  'private-file': ['zero-on-discard', 'ksm-mergeable'],
};

/**
 * Of resident guest RAM (`rssBytes`, of which `anonymousBytes` anonymous), the bytes that are
 * still the backing file's: page cache shared with every other mapping of the file. 0 for a
 * backing that is not a file's.
 */
export function fileSharedBytes(kind: RamBackingKind, resident: { rssBytes: number; anonymousBytes: number }): number {
  // In a private file mapping, a page the guest wrote is an anonymous copy; the rest is the file's.
  return kind === 'private-file' ? resident.rssBytes - resident.anonymousBytes : 0;
}

/** Describes a request in words, for errors. */
export function describeBacking(request: RamBackingRequest): string {
  switch (request.kind) {
    case 'anonymous': return 'private anonymous guest RAM';
    case 'memfd': return 'memfd-backed guest RAM';
    case 'private-file': return `guest RAM mapped privately from ${request.path}`;
  }
}

/**
 * Opens or creates the backing `request` describes for `sizeBytes` of guest RAM. A file that is
 * missing, unreadable or too small is a {@link BackingFileError}; nothing stays open then.
 */
export function openBacking(request: RamBackingRequest, sizeBytes: number, vmName: string): RamBacking {
  switch (request.kind) {
    case 'anonymous':
      return { kind: 'anonymous' };
    case 'memfd': {
      const fd = createMemfd(`pvisor-ram-${vmName}`, MFD_CLOEXEC);
      try {
        // A sparse file of guest RAM's size: pages are allocated when the guest first writes them.
        ftruncateSync(fd, sizeBytes);
      } catch (e) {
        closeFd(fd);
        throw e;
      }
      return { kind: 'memfd', fd };
    }
    case 'private-file': {
      let fd: number;
      try {
        fd = request.fd === undefined ? openSync(request.path, 'r') : dupFd(request.fd);
      } catch (e) {
        throw new BackingFileError(request.path, `cannot open it as guest RAM: ${(e as Error).message}`, { cause: e });
      }
      const size = fstatSync(fd).size;
      if (size < sizeBytes) {
        closeFd(fd);
        throw new BackingFileError(request.path, `is ${size} bytes, smaller than guest RAM (${sizeBytes} bytes)`);
      }
      return { kind: 'private-file', fd, path: request.path };
    }
  }
}
